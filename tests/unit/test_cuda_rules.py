"""CUDA's rules (docs/STYLE: "CUDA's rules, from its docs"), held by what a CPU can check: the pure
plans and choices the CUDA paths obey, and the source itself where the rule is "never call this".
The halves that need a GPU skip without one."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def calls_of(name: str, *folders: str) -> list[str]:
    """`path:line` of every call of an attribute or function named `name` in the folders' modules."""
    found = []
    for folder in folders:
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Call):
                    f = node.func
                    called = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
                    if called == name:
                        found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def test_nothing_the_services_run_empties_the_cuda_cache() -> None:
    """`torch.cuda.empty_cache` waits for the whole device (training's stream too): never on a hot
    path, and a failed prefill request no longer calls it (the allocator frees its cache itself
    when an allocation does not fit)."""
    assert calls_of("empty_cache", "services", "shared") == []
