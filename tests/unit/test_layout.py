"""The layout's import rules, checked by reading the source with `ast` (nothing is imported).

* Nothing in `services/` or `shared/` imports `bubbletea`, `sim` or `loadgen`: the services must run
  without the person's tools.
* Nothing in `shared/` or `sim/` imports `bubbletea`, the command a person runs: the simulator
  takes what it shares with the command from `shared/` (its figures: `shared/figures/`).
* No service imports another: `services/<a>` never imports `services.<b>`.
* No import cycle among the product's modules (`shared`, `services`, `sim`, `bubbletea`, `loadgen`,
  `bubbletea_vllm`), nor among those packages. Every import counts, wherever it is: one in a
  function body or under `if TYPE_CHECKING:` only hides a cycle (the two modules still need each
  other). Relative imports are resolved; `from pkg import sub` counts as importing `pkg.sub` when
  that is a module, otherwise `pkg`; the implicit import of parent packages is not an edge (a
  package's `__init__` re-exporting its submodules is not a cycle).

Every check looks at every import in a file, function bodies included.

* `shared/policies` is pure: it imports nothing that does I/O or reads a clock (`asyncio`, `redis`,
  `socket`, `threading`, `time`, `subprocess`, `aiohttp`, the bus): a decision takes `now` as an input.
* A product or benchmark module past 400 lines, or a function past 80, is listed with a one-line
  reason (`LONG_MODULES`, `LONG_FUNCTIONS`); an exemption no longer needed is a warning, not a failure.
* `shared/` has no loose module: its code lives in subpackages whose names say what for.
* The subpackages of `shared/` are layers (`LAYERS`, lowest first, `config` the ground floor): an
  import between two of them runs down, never up, so no two of them tie both ways.

The classes (read the same way; a base is resolved through its module's imports and definitions,
and "a base" is one another product class derives from, directly or not). One object owns each
invariant; a class is not cut into mixins that hold no state and lean on each other:

* No stub in a base: a method of a base whose body (past its docstring) is only `raise
  NotImplementedError` is refused, unless it is an interface's: decorated `@abstractmethod` (an
  `abc.ABC`), or in a `typing.Protocol`. A mixin stubbing what its partner or its host defines is
  what this refuses.
* No attribute declared "for the type checker": a bare class-level annotation (`x: T`, no value)
  in a base is refused when the base does not set `x` up itself (in its body, or `self.x = ...`
  in its `__init__`, `__post_init__` or `__new__`) while a class deriving from it, or another base
  of one, gives `x` a value or defines it. Records (dataclasses, named tuples, typed dicts, msgspec
  structs, enums), Protocols and ABC interfaces are not asked: their annotations are their fields
  or their contract. `test_the_class_checks_find_a_mixin_and_pass_interfaces_and_records` pins
  both rules on a small source.
"""

from __future__ import annotations

import ast
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: The product's packages, and the folder each lies in (the vLLM connector is its own distribution).
SOURCE_ROOTS = {
    "shared": ROOT,
    "services": ROOT,
    "sim": ROOT,
    "bubbletea": ROOT,
    "loadgen": ROOT,
    "bubbletea_vllm": ROOT / "bubbletea-vllm",
}
PACKAGES = tuple(SOURCE_ROOTS)
#: What the services and the code they share must never import.
TOOLS = ("bubbletea", "sim", "loadgen")
#: The command a person runs: neither `shared/` nor the simulator imports it.
CLI = "bubbletea"


@dataclass(frozen=True)
class Import:
    module: str  # the absolute name, as resolved
    line: int


def module_name(path: Path) -> str:
    top = path.relative_to(ROOT).parts[0]
    source_root = next((r for r in SOURCE_ROOTS.values() if r != ROOT and r.name == top), ROOT)
    parts = list(path.relative_to(source_root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def source_files(*packages: str) -> list[Path]:
    dirs = [SOURCE_ROOTS[pkg] / pkg for pkg in packages]
    return sorted(p for d in dirs if d.is_dir() for p in d.rglob("*.py"))


def is_module(name: str) -> bool:
    source_root = SOURCE_ROOTS.get(top(name), ROOT)
    path = source_root.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def imports(path: Path) -> Iterator[Import]:
    """Every import in a file (module level, function bodies, `if TYPE_CHECKING:`), resolved to
    absolute module names."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    yield from imports_in(tree, package)


def imports_in(tree: ast.AST, package: str) -> Iterator[Import]:
    """Every import anywhere in `tree`, of a module in `package` (relative imports resolved)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node, package)
            for alias in node.names:
                sub = f"{base}.{alias.name}" if base else alias.name
                yield Import(sub if is_module(sub) else base, node.lineno)


def _absolute(node: ast.ImportFrom, package: str) -> str:
    if node.level == 0:
        return node.module or ""
    parts = package.split(".")
    base = ".".join(parts[: len(parts) - (node.level - 1)])
    return f"{base}.{node.module}" if node.module else base


def top(name: str) -> str:
    return name.partition(".")[0]


def import_graph() -> dict[str, set[str]]:
    """Module -> the product's modules it imports, over every file of the product's packages."""
    graph: dict[str, set[str]] = {}
    for path in source_files(*PACKAGES):
        name = module_name(path)
        graph.setdefault(name, set()).update(
            imp.module for imp in imports(path) if top(imp.module) in PACKAGES and imp.module != name
        )
    return graph


def test_every_import_counts_wherever_it_is_and_relative_ones_are_resolved() -> None:
    """The checker itself: imports under TYPE_CHECKING and in function bodies count, a relative
    import is resolved against the importing module's package, `from pkg import sub` names `pkg.sub`
    when that is a module."""
    source = """
from typing import TYPE_CHECKING
if TYPE_CHECKING:
    from shared.bus.bus import Bus
def later():
    from ..figures import runstats
    from . import connection
    import sim.run
from .consumer import Consumer
"""
    got = {i.module for i in imports_in(ast.parse(source), "shared.bus")}
    want = {"typing", "shared.bus.bus", "shared.figures.runstats", "shared.bus.connection", "sim.run"}
    assert got == want | {"shared.bus.consumer"}


def test_the_graph_sees_every_package() -> None:
    graph = import_graph()
    assert {top(m) for m in graph} == set(PACKAGES), "a package was not found: is ROOT right?"
    assert "bubbletea_vllm.scheduler" in graph["bubbletea_vllm.connector"]  # the connector's own folder


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


#: What a pure policy never imports: I/O and clocks (its caller passes `now` and executes decisions).
IMPURE = ("asyncio", "redis", "socket", "threading", "time", "subprocess", "aiohttp", "shared.bus")


def test_the_policies_do_no_io_and_read_no_clock() -> None:
    files = source_files("shared")
    policies = [p for p in files if p.relative_to(ROOT).parts[:2] == ("shared", "policies")]
    assert len(policies) > 10, "no policy found: is ROOT right?"
    bad = [
        f"{path.relative_to(ROOT)}:{imp.line} imports {imp.module}"
        for path in policies
        for imp in imports(path)
        if any(imp.module == m or imp.module.startswith(m + ".") for m in IMPURE)
    ]
    assert not bad, "shared/policies must stay pure (now is an input; the service does the I/O):\n" + "\n".join(bad)


def test_shared_and_sim_do_not_import_the_command() -> None:
    files = source_files("shared", "sim")
    assert files, "no source found: is ROOT right?"
    bad = [
        f"{path.relative_to(ROOT)}:{imp.line} imports {imp.module}"
        for path in files
        for imp in imports(path)
        if top(imp.module) == CLI
    ]
    assert not bad, (
        "shared/ and sim/ must not import the bubbletea command's package (what they share with it "
        "lives in shared/, its figures in shared/figures/):\n" + "\n".join(bad)
    )


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
    cycles = find_cycles(import_graph())
    assert not cycles, "import cycles (every import counts, function-local ones too):\n" + "\n".join(
        " -> ".join(c) for c in cycles
    )


def test_no_cycle_between_the_packages() -> None:
    packages: dict[str, set[str]] = {}
    for module, imported in import_graph().items():
        packages.setdefault(top(module), set()).update(top(m) for m in imported if top(m) != top(module))
    cycles = find_cycles(packages)
    assert not cycles, "the packages import each other:\n" + "\n".join(" -> ".join(c) for c in cycles)


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


#: The most lines a product or benchmark module may have unlisted. Past it, a module is cut where its
#: meaning changes, or listed in `LONG_MODULES` with why it stays whole: the cap is a warning, not a target.
MAX_MODULE_LINES = 400
#: The most lines a function may have unlisted: its `def` line to its last line (decorators left out,
#: the docstring and comments counted: they are what a reader scrolls past), as `ast` reports them.
MAX_FUNCTION_LINES = 80

#: Modules allowed past MAX_MODULE_LINES: path -> why it stays one file.
LONG_MODULES: dict[str, str] = {
    "loadgen/options.py": "one parser: every option and the check across options read in one place",
    "shared/dataplane/kernel_net.py": "the kernel WAN's pure plan: its topology and shaping explained beside the code",
    "bench/pd_vllm.py": "one bench: its docstring defines every figure, beside the code that computes it",
    "shared/bus/consumer.py": "one consumer's read, handle and drain; its reclaimer and in-hand table are apart",
    "shared/wire/keys.py": "every Redis key and stream in one place, each with its bound and its hash tag",
}

#: Functions allowed past MAX_FUNCTION_LINES: "path::Class.function" -> why it stays one function.
LONG_FUNCTIONS: dict[str, str] = {
    # tables: one entry a line, read down, nothing to cut by meaning
    "services/prefill_queue/openapi.py::spec": "the OpenAPI document as one literal, read as the document",
    "services/prefill_queue/metrics.py::Metrics.__init__": "the front door's metrics, one declaration each",
    "services/dispatcher/metrics.py::DispatcherMetrics.__init__": "the dispatcher's metrics, one declaration each",
    "services/stage_worker/metrics.py::WorkerMetrics.__init__": "the stage worker's metrics, one declaration each",
    # one lifetime: resources started and stopped in pairs inside one function, so their order reads at once
    "services/stage_worker/worker.py::serve": "the worker's start-up and stop order, each start beside its stop",
    "services/wan_broker/broker.py::serve": "the broker's link drivers started and stopped in one order",
    "services/dispatcher/serve.py::lead": "one leader term: its consumers started, the tick loop, then each stopped",
    "services/prefill_queue/decoding.py::whole": "one response's prefill then decode, JSON or events, in one flow",
    "bubbletea/launcher/train.py::run_training": "one training run's set-up, loop and teardown in order",
    # benchmarks: one run's steps in order, each a few lines
    "bench/bubble_fill.py::main": "its arguments, then the cases run in order",
    "bench/chaos.py::chaos": "one chaos run's set-up, faults and checks in order",
    "bench/soak.py::main": "its arguments, then one soak run in order",
    "bench/takeover.py::arm": "one arm's processes started, killed and measured in order",
    "bench/lib/harness.py::summarise": "one case's figures, one line each",
    "bench/lib/atlas_summary.py::summarize": "the JSON line's figures and targets, one line each",
}


# Every warning is an error in this suite (pyproject.toml); this one is only to be seen.
@pytest.mark.filterwarnings("default:stale size exemption")
def test_long_modules_and_functions_are_listed_with_a_reason() -> None:
    """Past the caps only what `LONG_MODULES` and `LONG_FUNCTIONS` list; a listed one now short or
    gone is a warning (the refactor that shortened it may land before the list is trimmed)."""
    files = source_files(*PACKAGES) + sorted((ROOT / "bench").rglob("*.py"))
    long_modules, long_functions = {}, {}
    for path in files:
        rel = str(path.relative_to(ROOT))
        source = path.read_text(encoding="utf-8")
        if (n := len(source.splitlines())) > MAX_MODULE_LINES:
            long_modules[rel] = f"{rel}: {n} lines (the cap is {MAX_MODULE_LINES})"
        for name, node in functions(ast.parse(source, filename=rel)):
            if (n := (node.end_lineno or node.lineno) - node.lineno + 1) > MAX_FUNCTION_LINES:
                long_functions[f"{rel}::{name}"] = (
                    f"{rel}:{node.lineno} {name}: {n} lines (the cap is {MAX_FUNCTION_LINES})"
                )
    unlisted = [
        why for key, why in {**long_modules, **long_functions}.items() if key not in {**LONG_MODULES, **LONG_FUNCTIONS}
    ]
    stale = [k for k in LONG_MODULES if k not in long_modules] + [k for k in LONG_FUNCTIONS if k not in long_functions]
    for key in stale:
        warnings.warn(
            StaleExemption(f"stale size exemption: {key} is short now (or gone): take it off the list"), stacklevel=1
        )
    assert not unlisted, "cut these where their meaning changes, or list them with a one-line reason:\n" + "\n".join(
        unlisted
    )


class StaleExemption(UserWarning):
    """A listed long module or function that is no longer long."""


def functions(tree: ast.AST, prefix: str = "") -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """Every function in `tree`, nested ones too, with its qualified name (`Class.method`, `outer.inner`)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield prefix + node.name, node
            yield from functions(node, f"{prefix}{node.name}.")
        elif isinstance(node, ast.ClassDef):
            yield from functions(node, f"{prefix}{node.name}.")
        else:
            yield from functions(node, prefix)


def test_the_size_check_names_functions_by_their_qualified_name() -> None:
    """The checker itself: methods and nested functions are named through their class or function."""
    source = """
class A:
    def m(self):
        def inner():
            pass
if True:
    async def f():
        pass
"""
    assert [name for name, _ in functions(ast.parse(source))] == ["A.m", "A.m.inner", "f"]


def test_shared_has_no_loose_module() -> None:
    """`shared/` is laid out by purpose: its code lives in subpackages whose names say what for."""
    loose = sorted(p.name for p in (ROOT / "shared").glob("*.py") if p.name != "__init__.py")
    assert not loose


# --- the layers of `shared/` ------------------------------------------------------------------

#: The subpackages of `shared/`, lowest first: each imports only those below it (never one above,
#: nor two importing each other). `config` (the spec, the environment, errors) is the ground floor;
#: `runtime` (logging, priorities, the embedded Redis), `wire` (messages, stream and key names,
#: statuses) and `bus` carry the processes; `model` computes; `policies` decide (pure) over the
#: model's shape; `control` keeps the control plane's records in Redis with the policies' values;
#: `figures` measure a run with the policies' rules; `dataplane` moves tensors; `service` is the
#: skeleton every service's `__main__` runs on.
LAYERS = ("config", "runtime", "wire", "bus", "model", "policies", "control", "figures", "dataplane", "service")


def runs_up(own: str, module: str) -> bool:
    """Whether `shared.<own>` importing `module` reaches a subpackage of `shared/` above it in
    `LAYERS` (or one `LAYERS` does not name)."""
    names = module.split(".")
    if names[0] != "shared" or len(names) < 2 or names[1] == own:
        return False
    return own not in LAYERS or names[1] not in LAYERS or LAYERS.index(names[1]) > LAYERS.index(own)


def test_every_import_between_the_subpackages_of_shared_runs_down() -> None:
    subpackages = {p.name for p in (ROOT / "shared").iterdir() if (p / "__init__.py").is_file()}
    assert subpackages == set(LAYERS), f"name every subpackage of shared/ in LAYERS, in its place: {subpackages}"
    bad = [
        f"{path.relative_to(ROOT)}:{imp.line} imports {imp.module}"
        for path in source_files("shared")
        if len(path.relative_to(ROOT).parts) > 2  # not shared/__init__.py
        for imp in imports(path)
        if runs_up(path.relative_to(ROOT).parts[1], imp.module)
    ]
    assert not bad, (
        f"an import runs up the layers of shared/ ({' < '.join(LAYERS)}): move the code down, or the "
        "importer up:\n" + "\n".join(bad)
    )


def test_an_import_that_runs_up_is_refused() -> None:
    """The checker itself: config importing the model (in a function body too) runs up; the model
    importing config, or a module of its own package, runs down."""
    source = "def f():\n    from shared.model import gpt\nimport shared.config.spec\nfrom . import x\n"
    assert [i.module for i in imports_in(ast.parse(source), "shared.config") if runs_up("config", i.module)] == [
        "shared.model.gpt"
    ]
    assert [i.module for i in imports_in(ast.parse(source), "shared.model") if runs_up("model", i.module)] == []


# --- classes: one object per invariant, no mixin stubbing its partner ----------------------------

#: Bases whose classes make fields of their class-level annotations, or declare an interface.
RECORD_BASES = {
    "typing.Protocol",
    "typing_extensions.Protocol",
    "typing.NamedTuple",
    "typing.TypedDict",
    "typing_extensions.TypedDict",
    "msgspec.Struct",
    "abc.ABC",
    "enum.Enum",
}
PROTOCOLS = {"typing.Protocol", "typing_extensions.Protocol"}


@dataclass
class Klass:
    """A product class as its source says: its qualified name, its bases (qualified where an import
    or a definition in its module says what they are), and its body."""

    name: str
    node: ast.ClassDef
    bases: list[str]


def _dotted(expr: ast.expr) -> str:
    """`a.b.C` for a base written `a.b.C` or `a.b.C[T]`; "" for anything else."""
    if isinstance(expr, ast.Subscript):
        return _dotted(expr.value)
    if isinstance(expr, ast.Attribute):
        head = _dotted(expr.value)
        return f"{head}.{expr.attr}" if head else ""
    return expr.id if isinstance(expr, ast.Name) else ""


def classes_in(modules: dict[str, tuple[str, str]]) -> dict[str, Klass]:
    """Every class of `modules` (module name -> (its package, its source)), by qualified name."""
    out: dict[str, Klass] = {}
    for module, (package, source) in modules.items():
        tree = ast.parse(source)
        names = {n.name: f"{module}.{n.name}" for n in tree.body if isinstance(n, ast.ClassDef)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names.update({a.asname: a.name for a in node.names if a.asname})
                names.update({a.name.partition(".")[0]: a.name.partition(".")[0] for a in node.names if not a.asname})
            elif isinstance(node, ast.ImportFrom):
                base = _absolute(node, package)
                names.update({a.asname or a.name: f"{base}.{a.name}" for a in node.names})
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                bases = []
                for b in map(_dotted, node.bases):
                    head, _, rest = b.partition(".")
                    bases.append(".".join(filter(None, (names.get(head, head), rest))))
                out[f"{module}.{node.name}"] = Klass(f"{module}.{node.name}", node, bases)
    return out


def product_classes() -> dict[str, Klass]:
    modules = {}
    for path in source_files(*PACKAGES):
        name = module_name(path)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        modules[name] = (package, path.read_text(encoding="utf-8"))
    return classes_in(modules)


def _ancestors(name: str, classes: dict[str, Klass]) -> set[str]:
    """Every base of class `name`, transitively through the product's classes (qualified)."""
    seen: set[str] = set()
    todo = list(classes[name].bases)
    while todo:
        b = todo.pop()
        if b not in seen:
            seen.add(b)
            todo += classes[b].bases if b in classes else []
    return seen


def _decorated(node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef, name: str) -> bool:
    """Whether `node` has the decorator `name` (`@name`, `@mod.name`, `@name(...)`)."""
    decorators = (d.func if isinstance(d, ast.Call) else d for d in node.decorator_list)
    return any(_dotted(d).rpartition(".")[2] == name for d in decorators)


def _methods(node: ast.ClassDef) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    return [n for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def _only_raises_not_implemented(f: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    body = f.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # its docstring
    if len(body) != 1 or not isinstance(body[0], ast.Raise) or body[0].exc is None:
        return False
    exc = body[0].exc
    return _dotted(exc.func if isinstance(exc, ast.Call) else exc) == "NotImplementedError"


def _is_interface(name: str, classes: dict[str, Klass]) -> bool:
    """A Protocol, or an ABC interface: it derives from `abc.ABC` or has an `@abstractmethod`."""
    ancestors = _ancestors(name, classes)
    abstract = any(_decorated(f, "abstractmethod") for f in _methods(classes[name].node))
    return bool(ancestors & (PROTOCOLS | {"abc.ABC"})) or abstract


def _bases_of_others(classes: dict[str, Klass]) -> set[str]:
    return {b for c in classes.values() for b in _ancestors(c.name, classes) if b in classes}


def mixin_stubs(classes: dict[str, Klass]) -> list[str]:
    """`Class.method` for each stub (a body of only `raise NotImplementedError`) in a class another
    derives from, unless it is an interface's: `@abstractmethod`, or in a Protocol."""
    found = []
    for name in sorted(_bases_of_others(classes)):
        protocol = bool(_ancestors(name, classes) & PROTOCOLS)
        for f in _methods(classes[name].node):
            if _only_raises_not_implemented(f) and not protocol and not _decorated(f, "abstractmethod"):
                found.append(f"{name}.{f.name}")
    return found


SETUP = ("__init__", "__post_init__", "__new__")


def _given(node: ast.ClassDef, *, setup_only: bool) -> set[str]:
    """The attributes class `node` gives a value: in its body (`x = ...`, `x: T = ...`, a dataclass's
    `x: T`), and `self.x = ...` (or `+=`, or `: T =`) in its methods, or in its set-up only
    (`__init__`, `__post_init__`, `__new__`) with `setup_only`."""
    out = set()
    dataclass_ = _decorated(node, "dataclass")
    for n in node.body:
        if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name) and (n.value is not None or dataclass_):
            out.add(n.target.id)
        elif isinstance(n, ast.Assign):
            out.update(t.id for t in n.targets if isinstance(t, ast.Name))
    for f in _methods(node):
        if setup_only and f.name not in SETUP:
            continue
        for n in ast.walk(f):
            one = isinstance(n, ast.AnnAssign | ast.AugAssign)
            targets = n.targets if isinstance(n, ast.Assign) else [n.target] if one else []
            for t in targets:
                for e in t.elts if isinstance(t, ast.Tuple) else [t]:
                    if isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name) and e.value.id == "self":
                        out.add(e.attr)
    return out


def redeclared(classes: dict[str, Klass]) -> list[str]:
    """`Class.attribute` for each bare class-level annotation (`x: T`, no value) in a class another
    derives from, that the class does not set up itself (`_given` with `setup_only`) and that a
    class deriving from it, or another base of one (its partner), gives a value or defines as a
    method: declared "for the type checker". Records (dataclasses, named tuples, typed dicts,
    msgspec structs, enums: their annotations are fields) and interfaces (`_is_interface`) are
    not asked."""
    found = []
    for name in sorted(_bases_of_others(classes)):
        c = classes[name]
        if _decorated(c.node, "dataclass") or _ancestors(name, classes) & RECORD_BASES or _is_interface(name, classes):
            continue
        heirs = [k.name for k in classes.values() if name in _ancestors(k.name, classes)]
        above = _ancestors(name, classes) | {name}
        others = {a for h in heirs for a in _ancestors(h, classes) if a in classes and a not in above} | set(heirs)
        given = set().union(*(_given(classes[k].node, setup_only=False) for k in others))
        given |= {f.name for k in others for f in _methods(classes[k].node)}
        own = _given(c.node, setup_only=True)
        for n in c.node.body:
            bare = isinstance(n, ast.AnnAssign) and n.value is None and isinstance(n.target, ast.Name)
            if bare and n.target.id not in own and n.target.id in given:
                found.append(f"{name}.{n.target.id}")
    return found


def test_no_mixin_stubs_its_partner() -> None:
    classes = product_classes()
    assert not mixin_stubs(classes), "compose objects that own their state; an interface says @abstractmethod"


def test_no_attribute_is_redeclared_for_the_type_checker() -> None:
    classes = product_classes()
    assert not redeclared(classes), "compose objects that own their state instead of mixing in one"


MIXED = """
import abc
from dataclasses import dataclass
from typing import Protocol


class Half:
    held: float  # the host's, declared here for the type checker

    def room(self) -> float:
        return self.window() - self.held

    def window(self) -> float:  # the partner's
        raise NotImplementedError


@dataclass
class Host(Half):
    held: float = 0.0

    def window(self) -> float:
        return 1.0


class Shape(abc.ABC):
    sides: int  # an interface says what its implementers have

    @abc.abstractmethod
    def area(self) -> float:
        raise NotImplementedError


class Square(Shape):
    sides = 4

    def area(self) -> float:
        return 1.0


class Sized(Protocol):
    size: int

    def grow(self) -> None:
        raise NotImplementedError


class Box(Sized):
    def __init__(self) -> None:
        self.size = 0

    def grow(self) -> None:
        self.size += 1


class Base:
    count: int  # its own, set in its own __init__

    def __init__(self) -> None:
        self.count = 0


class Child(Base):
    def __init__(self) -> None:
        super().__init__()
        self.count = 1
"""


def test_the_class_checks_find_a_mixin_and_pass_interfaces_and_records() -> None:
    classes = classes_in({"m": ("", MIXED)})
    assert classes["m.Host"].bases == ["m.Half"] and classes["m.Shape"].bases == ["abc.ABC"]
    assert mixin_stubs(classes) == ["m.Half.window"]
    assert redeclared(classes) == ["m.Half.held"]
