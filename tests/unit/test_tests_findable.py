"""A module of a service (`services/**`) or a policy (`shared/policies/**`) with logic (a function
or class at module level) has a `test_<module>.py` somewhere under `tests/`, or its docstring names
the tests that cover it ("Tested by: tests/...py"). A test file a docstring names exists. The source
is read with `ast`; nothing is imported."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NAMED = re.compile(r"tests/\S+?\.py")


def _modules() -> list[Path]:
    """The services' and policies' modules, entry points (`__init__`, `__main__`) left out."""
    found = [*ROOT.glob("services/**/*.py"), *ROOT.glob("shared/policies/**/*.py")]
    return sorted(p for p in found if p.name not in ("__init__.py", "__main__.py"))


def _has_logic(tree: ast.Module) -> bool:
    return any(isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) for n in tree.body)


def _named_tests(path: Path) -> list[str]:
    return NAMED.findall(ast.get_docstring(ast.parse(path.read_text())) or "")


def test_every_module_with_logic_has_its_test_file_or_names_its_tests() -> None:
    test_files = {p.name for p in ROOT.glob("tests/**/test_*.py")}
    lost = []
    for path in _modules():
        tree = ast.parse(path.read_text())
        if not _has_logic(tree):
            continue
        if f"test_{path.stem}.py" not in test_files and not NAMED.search(ast.get_docstring(tree) or ""):
            lost.append(path.relative_to(ROOT).as_posix())
    assert not lost, "no test_<module>.py and no 'Tested by: tests/...py' in the docstring: " + ", ".join(lost)


def test_every_test_a_docstring_names_exists() -> None:
    missing = [
        f"{path.relative_to(ROOT).as_posix()} names {named}"
        for path in _modules()
        for named in _named_tests(path)
        if not (ROOT / named).is_file()
    ]
    assert not missing, "a docstring names a test file that does not exist: " + "; ".join(missing)
