"""The layout's import rules (DESIGN.md, "Layout"), checked by reading the source with `ast`.

* Nothing in `services/` or `shared/` imports `bubbletea`, `sim` or `loadgen` (anywhere in a file,
  function bodies included): the services must run without the person's tools.
* No service imports another: `services/<a>` never imports `services.<b>`.
* No import cycle among the project's modules (`shared`, `services`, `bubbletea`, `loadgen`,
  `sim`). Only imports run when a module is imported count: those in function bodies (run later)
  and under `if TYPE_CHECKING:` (never run) are ignored. `from pkg import sub` counts as importing
  `pkg.sub` when that is a module, otherwise `pkg`; the implicit import of parent packages is not
  an edge (a package's `__init__` re-exporting its submodules is not a cycle).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("shared", "services", "bubbletea", "loadgen", "sim")
#: What the services and the code they share must never import.
TOOLS = ("bubbletea", "sim", "loadgen")


@dataclass(frozen=True)
class Import:
    module: str  # the absolute name, as resolved
    line: int
    at_load: bool  # runs when the importing module is imported


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def source_files(*packages: str) -> list[Path]:
    return sorted(p for pkg in packages if (ROOT / pkg).is_dir() for p in (ROOT / pkg).rglob("*.py"))


def is_module(name: str) -> bool:
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def imports(path: Path) -> Iterator[Import]:
    """Every import in a file, resolved to absolute module names."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    yield from _walk(tree, package, at_load=True)


def _walk(node: ast.AST, package: str, *, at_load: bool) -> Iterator[Import]:
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.Import):
            for alias in child.names:
                yield Import(alias.name, child.lineno, at_load)
        elif isinstance(child, ast.ImportFrom):
            base = _absolute(child, package)
            for alias in child.names:
                sub = f"{base}.{alias.name}" if base else alias.name
                yield Import(sub if is_module(sub) else base, child.lineno, at_load)
        elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            yield from _walk(child, package, at_load=False)
        elif isinstance(child, ast.If) and _is_type_checking(child.test):
            for stmt in child.body:
                yield from _walk(ast.Module(body=[stmt], type_ignores=[]), package, at_load=False)
            for stmt in child.orelse:
                yield from _walk(ast.Module(body=[stmt], type_ignores=[]), package, at_load=at_load)
        else:
            yield from _walk(child, package, at_load=at_load)


def _absolute(node: ast.ImportFrom, package: str) -> str:
    if node.level == 0:
        return node.module or ""
    parts = package.split(".")
    base = ".".join(parts[: len(parts) - (node.level - 1)])
    return f"{base}.{node.module}" if node.module else base


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def top(name: str) -> str:
    return name.partition(".")[0]


def test_services_and_shared_do_not_import_the_tools() -> None:
    files = source_files("services", "shared")
    assert files, "no source found: is ROOT right?"
    bad = [
        f"{path.relative_to(ROOT)}:{imp.line} imports {imp.module}"
        for path in files
        for imp in imports(path)
        if top(imp.module) in TOOLS
    ]
    assert not bad, "services/ and shared/ must not import bubbletea, sim or loadgen:\n" + "\n".join(bad)


def test_no_service_imports_another() -> None:
    bad = []
    for path in source_files("services"):
        parts = path.relative_to(ROOT).parts
        if len(parts) < 3:  # services/__init__.py
            continue
        own = parts[1]
        for imp in imports(path):
            names = imp.module.split(".")
            if names[0] == "services" and len(names) > 1 and names[1] != own:
                bad.append(f"{path.relative_to(ROOT)}:{imp.line} imports {imp.module}")
    assert not bad, "a service must not import another service (share code through shared/):\n" + "\n".join(bad)


def test_no_import_cycles() -> None:
    graph: dict[str, set[str]] = {}
    for path in source_files(*PACKAGES):
        graph[module_name(path)] = {imp.module for imp in imports(path) if imp.at_load and top(imp.module) in PACKAGES}
    cycles = find_cycles(graph)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (as a path back to its start) per strongly connected component that has one."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def connect(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph.get(v, ()):
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return [_cycle_in(c, graph) for c in components]


def _cycle_in(component: list[str], graph: dict[str, set[str]]) -> list[str]:
    members, start = set(component), component[0]
    path, seen = [start], {start}
    while True:  # every member of a strongly connected component has a successor inside it
        nxt = min(w for w in graph[path[-1]] if w in members)
        if nxt in seen:
            return [*path[path.index(nxt) :], nxt]
        path.append(nxt)
        seen.add(nxt)


def test_find_cycles_finds_them() -> None:
    """The checker itself: a cycle is found and named; a diamond is not a cycle."""
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert find_cycles({"a": {"b", "c"}, "b": {"d"}, "c": {"d"}, "d": set()}) == []
    assert find_cycles({"a": {"a"}}) == [["a", "a"]]
