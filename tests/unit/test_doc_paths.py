"""The README and docs/ name only code that exists: every `path/to/file.py:name` names a file of
the repository that defines `name` (a function, a class, a method as `Class.method`, or a module
constant), every `path/to/file.py` in backticks names a file that exists, and every dotted
`package.module.name` in backticks names a module of ours that defines it. A module moved or a
function renamed fails here with the page and the reference."""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
#: Where a path is looked up: the repository, then the vLLM connector's package root (its docs
#: name `bubbletea_vllm/...` as its own code does).
BASES = (ROOT, ROOT / "bubbletea-vllm")
#: `dir/file.py:name` or `dir/file.py:Class.method`.
REFERENCE = re.compile(r"((?:[\w.-]+/)+[\w.-]+\.py):([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)?)")
#: `dir/file.py` in backticks, alone or followed by `:name`.
PATH = re.compile(r"`((?:[\w.-]+/)+[\w.-]+\.py)(?::[\w.]+)?`")
#: `package.module[.name[.member]]` in backticks, for our own top-level packages.
DOTTED = re.compile(r"`((?:services|shared|bubbletea|sim|loadgen|bench)(?:\.\w+)+)`")
#: `from package.module import name` in the pages' code blocks, for our own top-level packages.
IMPORT = re.compile(r"from ((?:services|shared|bubbletea|sim|loadgen|bench)(?:\.\w+)+) import (\w+)")


def resolve(path: str) -> Path | None:
    return next((base / path for base in BASES if (base / path).is_file()), None)


@cache
def names_in(file: Path) -> tuple[set[str], set[str]]:
    """What `file` defines: every function and class at any depth and every module-level assigned
    name; and every `Class.method` (methods and nested classes of a class)."""
    tree = ast.parse(file.read_text())
    plain: set[str] = set()
    dotted: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            plain.add(node.name)
        if isinstance(node, ast.ClassDef):
            for member in node.body:
                if isinstance(member, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                    dotted.add(f"{node.name}.{member.name}")
                elif isinstance(member, ast.AnnAssign) and isinstance(member.target, ast.Name):
                    dotted.add(f"{node.name}.{member.target.id}")
    for stmt in tree.body:
        if isinstance(stmt, ast.Assign):
            plain.update(t.id for t in stmt.targets if isinstance(t, ast.Name))
        elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            plain.add(stmt.target.id)
    return plain, dotted


def references() -> list[tuple[str, str, str]]:
    """(page, path, name) for every `path.py:name` in the pages."""
    return [(page.name, path, name) for page in PAGES for path, name in REFERENCE.findall(page.read_text())]


def test_every_file_function_reference_names_a_definition_that_exists() -> None:
    broken = []
    for page, path, name in references():
        file = resolve(path)
        if file is None:
            broken.append(f"{page}: {path}:{name}: no such file")
            continue
        plain, dotted = names_in(file)
        if name not in (dotted if "." in name else plain):
            broken.append(f"{page}: {path}:{name}: {path} defines no {name}")
    assert not broken, "\n".join(broken)


def test_every_python_path_in_backticks_exists() -> None:
    broken = sorted(
        {f"{page.name}: {path}" for page in PAGES for path in PATH.findall(page.read_text()) if resolve(path) is None}
    )
    assert not broken, "\n".join(broken)


def dotted_resolves(dotted: str) -> bool:
    """Whether `a.b.c.d` is a module (`a/b/c/d.py` or a package) or names defined in the longest
    module prefix of it (a name, or `Class.member`)."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        base = ROOT.joinpath(*parts[:cut])
        module = base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py"
        if module.is_file():
            rest = ".".join(parts[cut:])
            if not rest:
                return True
            plain, dotted_names = names_in(module)
            return rest in (dotted_names if "." in rest else plain)
    return False


def spec_field(dotted: str) -> bool:
    """`bubbletea.hold_ms` is the spec's `bubbletea` section, not our package: no module of that name."""
    head, _, rest = dotted.partition(".")
    first = rest.split(".")[0]
    return head == "bubbletea" and not (ROOT / head / f"{first}.py").is_file() and not (ROOT / head / first).is_dir()


def test_every_dotted_name_in_backticks_names_a_definition_that_exists() -> None:
    broken = sorted(
        {
            f"{page.name}: {name}"
            for page in PAGES
            for name in DOTTED.findall(page.read_text())
            if not spec_field(name) and not dotted_resolves(name)
        }
    )
    assert not broken, "\n".join(broken)


def test_every_import_in_a_code_block_names_a_definition_that_exists() -> None:
    broken = sorted(
        {
            f"{page.name}: from {module} import {name}"
            for page in PAGES
            for module, name in IMPORT.findall(page.read_text())
            if not dotted_resolves(f"{module}.{name}")
        }
    )
    assert not broken, "\n".join(broken)


def test_the_flows_in_the_architecture_name_a_function_at_each_step() -> None:
    """docs/architecture.md's two flows are maps: each numbered step names where it runs."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    for heading in ("## How one prefill request flows", "## How one training step flows"):
        start = text.index(heading)
        end = text.find("\n## ", start + 1)
        section = text[start : end if end > 0 else len(text)]
        steps = re.split(r"\n(?=\d+\. )", section)[1:]
        assert steps, heading
        for step in steps:
            assert REFERENCE.search(step), f"{heading}: a step names no file:function: {step[:80]}"
