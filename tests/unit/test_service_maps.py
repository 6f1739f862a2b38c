"""Every service's `__init__.py` opens with a map of its main flow: numbered steps, each naming
`file.py:function` (a path in the service, or from the repository root). The map stays true: each
`file.py:name` names a file that defines `name`, and each bare `Class.method` names a method some
module of the service (or the named policy files) defines. A module moved or renamed fails here."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.unit.test_doc_paths import names_in

ROOT = Path(__file__).resolve().parents[2]
SERVICES = sorted(p.parent for p in (ROOT / "services").glob("*/__init__.py"))
#: `file.py:name`, `dir/file.py:name` or `file.py:Class.method`.
REFERENCE = re.compile(r"((?:[\w.-]+/)*[\w-]+\.py):([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)?)")
#: `Class.method` in backticks, with no file before it.
BARE = re.compile(r"`([A-Z]\w*\.[a-z_]\w*)`")
STEP = re.compile(r"^\s*\d+\. ", re.MULTILINE)


def the_map(service: Path) -> str:
    return ast.get_docstring(ast.parse((service / "__init__.py").read_text())) or ""


def resolve(service: Path, path: str) -> Path | None:
    return next((base / path for base in (service, ROOT) if (base / path).is_file()), None)


def test_every_service_opens_with_a_map_of_its_main_flow() -> None:
    thin = [s.name for s in SERVICES if len(STEP.findall(the_map(s))) < 4]
    assert not thin, f"services whose __init__.py has no map of four steps or more: {thin}"


def test_every_step_of_every_map_names_code_that_exists() -> None:
    broken = []
    for service in SERVICES:
        text = the_map(service)
        files = list(service.rglob("*.py"))
        refs = REFERENCE.findall(text)
        assert refs, f"{service.name}: its map names no file.py:function"
        for path, name in refs:
            file = resolve(service, path)
            if file is None:
                broken.append(f"{service.name}: {path}:{name}: no such file")
                continue
            files.append(file)
            plain, dotted = names_in(file)
            if name not in (dotted if "." in name else plain):
                broken.append(f"{service.name}: {path} defines no {name}")
        for name in BARE.findall(text):
            if not any(name in names_in(f)[1] for f in files):
                broken.append(f"{service.name}: no module of the service defines {name}")
    assert not broken, "\n".join(broken)
