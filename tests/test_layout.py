"""The package layout stays true: no import cycles, the engine never imports the public
layer, no module grows past ~600 lines (docs/design.md, "Layout").

Reads the package's own source with ``ast`` (every import counts, also those inside
functions), so it needs no import of the package and names the offending lines.
"""
from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE_DIR = pathlib.Path(__file__).resolve().parent.parent / "src" / "poptorch"
# The packages shipped together (pyproject.toml): the core and its add-ons. The add-ons
# import the core; the core never imports an add-on (import cycles are looked for across
# all of them, so a core module that imports an add-on which imports ``poptorch`` is one).
PACKAGES = ("poptorch", "poptorch_geometric", "popdist", "poprun", "libpvti")
ENGINE = "poptorch._runtime"
# Importable from anywhere; they import nothing of the package but each other.
BASICS = {"poptorch.enums", "poptorch.errors", "poptorch._logging", "poptorch._devices",
          "poptorch._typing"}
MAX_LINES = 600


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, pathlib.Path]:
    return {_module_name(p): p for p in sorted(PACKAGE_DIR.rglob("*.py"))}


def _all_modules() -> dict[str, pathlib.Path]:
    """The modules of every package in ``PACKAGES``."""
    return {_module_name(p): p for package in PACKAGES
            for p in sorted((PACKAGE_DIR.parent / package).rglob("*.py"))}


def _dynamic_import(node: ast.AST) -> str | None:
    """The module of ``importlib.import_module("a.b")`` / ``__import__("a.b")`` (a
    literal, absolute name), else None."""
    if not (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str) and not node.args[0].value.startswith(".")):
        return None
    func = node.func
    if (isinstance(func, ast.Attribute) and func.attr == "import_module") or (
            isinstance(func, ast.Name) and func.id in ("import_module", "__import__")):
        return node.args[0].value
    return None


def _imports(name: str, path: pathlib.Path, known: set[str]) -> list[tuple[str, int]]:
    """(imported module, line) for every import of a package module in ``path``."""
    is_package = path.name == "__init__.py"
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names if a.name in known]
        elif _dynamic_import(node) in known:
            found.append((_dynamic_import(node) or "", node.lineno))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target not in known:
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.append((sub if sub in known else target, node.lineno))
    return found


def _graph(modules: dict[str, pathlib.Path] | None = None) -> dict[str, list[tuple[str, int]]]:
    modules = _modules() if modules is None else modules
    known = set(modules)
    return {name: _imports(name, path, known) for name, path in modules.items()}


def _cycles(graph: dict[str, list[tuple[str, int]]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), plus self-loops."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    result = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w, _ in graph[v]:
            if w not in index:
                visit(w)
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
            if len(component) > 1 or any(t == v for t, _ in graph[v]):
                result.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return result


def test_the_reader_sees_the_package():
    graph = _graph()
    assert "poptorch" in graph and "poptorch._runtime.program.device_loop" in graph
    # a known edge, so that a reader that finds nothing cannot pass the other tests
    assert "poptorch._runtime.batching.plan" in {
        t for t, _ in graph["poptorch._runtime.program.device_loop"]}


def test_no_import_cycles():
    """Across all the packages: within one, and between the core and its add-ons."""
    cycles = _cycles(_graph(_all_modules()))
    assert not cycles, "import cycles among package modules: " + "; ".join(
        " <-> ".join(c) for c in cycles)


def test_the_reader_sees_every_package():
    graph = _graph(_all_modules())
    assert {"poptorch_geometric.types", "popdist", "poprun", "libpvti"} <= set(graph)
    # an edge from an add-on into the core
    assert "poptorch" in {t for t, _ in graph["poptorch_geometric.types"]}


def test_the_cycle_reader_sees_circles_across_packages():
    """A core module importing an add-on that imports the core is a circle, also when the
    core imports it by name at run time (``importlib.import_module``)."""
    tree = ast.parse('import importlib\ndef f():\n    importlib.import_module("b.x")\n')
    assert _dynamic_import(tree.body[1].body[0].value) == "b.x"
    graph = {"a": [("a.core", 1)], "a.core": [("b.x", 3)], "b.x": [("a", 2)]}
    assert _cycles(graph) == [["a", "a.core", "b.x"]]


def test_the_core_never_imports_an_add_on():
    bad = [f"{name}:{line} imports {target}"
           for name, edges in _graph(_all_modules()).items()
           if name == "poptorch" or name.startswith("poptorch.")
           for target, line in edges if target.split(".")[0] != "poptorch"]
    assert not bad, ("poptorch is the core: the add-ons (poptorch_geometric, popdist, ...) "
                     "register themselves with it when imported:\n" + "\n".join(bad))


def test_engine_never_imports_the_public_layer():
    bad = []
    for name, edges in _graph().items():
        if name == ENGINE or name.startswith(ENGINE + "."):
            bad += [f"{name}:{line} imports {target}" for target, line in edges
                    if not (target == ENGINE or target.startswith(ENGINE + ".")
                            or target in BASICS)]
    assert not bad, ("poptorch._runtime may import only itself and "
                     f"{sorted(BASICS)}; pass what it needs in instead:\n" + "\n".join(bad))


def test_shared_basics_import_only_each_other():
    graph = _graph()
    bad = [f"{name}:{line} imports {target}" for name in BASICS for target, line in graph[name]
           if target not in BASICS]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("name,path", sorted(_modules().items()))
def test_module_size(name, path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, (f"{name} has {lines} lines (limit {MAX_LINES}): split it "
                                "by responsibility")


# -- the executor's state is read through its attributes, never through __dict__ -----
def _dict_reach_ins(tree: ast.AST) -> list[tuple[int, str, str]]:
    """(line, object, enclosing function) of every ``X.__dict__`` and ``vars(X)``."""
    found = []

    def visit(node: ast.AST, function: str) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            function = node.name
        if isinstance(node, ast.Attribute) and node.attr == "__dict__" \
                and isinstance(node.value, ast.Name):
            found.append((node.lineno, node.value.id, function))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id == "vars" and node.args \
                and isinstance(node.args[0], ast.Name):
            found.append((node.lineno, node.args[0].id, function))
        for child in ast.iter_child_nodes(node):
            visit(child, function)

    visit(tree, "")
    return found


def test_no_module_reaches_into_the_executors_dict():
    bad = []
    for name, path in _modules().items():
        executor_layer = name.startswith("poptorch.executor")
        for line, obj, function in _dict_reach_ins(ast.parse(path.read_text())):
            if obj == "executor" or (executor_layer and obj == "self"
                                     and function != "__getattr__"):
                bad.append(f"{name}:{line}: {obj}.__dict__ / vars({obj}) in {function}()")
    assert not bad, ("read and write the executor's state through its attributes "
                     "(all created in PoplarExecutor._init_state):\n" + "\n".join(bad))


def test_the_dict_reader_sees_reach_ins():
    """So that the test above cannot pass by finding nothing."""
    tree = ast.parse("def f(executor):\n    executor.__dict__['_x'] = 1\n    vars(executor)\n")
    assert [(line, obj) for line, obj, _ in _dict_reach_ins(tree)] == [
        (2, "executor"), (3, "executor")]


# -- what a compile produced is read from the Compilation, never from the executor ------
EXECUTOR_MODULE = "poptorch.executor.poplar_executor"
# The loose attributes the executor had before its compile produced one Compilation
# (``_runtime/compilation.py``): none of them may come back as a read of another object.
FORMER_STATE = {
    "_program", "_weights", "_device", "_constants", "_synthetic", "_replica_buffers",
    "_precision", "_optimizer_sync", "_backend", "_source", "_fast", "_signature",
    "_tensor_constants", "_buffers_list", "_optimizer_keys", "_device_optimizer",
    "_casting", "_autocast_hooks", "_io_checked", "_io_counts", "_compile_seconds",
    "_anchors", "_attached", "_config", "_executable"}


def _executor_state() -> set[str]:
    """The attributes ``PoplarExecutor._init_state`` creates (``self._x = ...``)."""
    tree = ast.parse(_modules()[EXECUTOR_MODULE].read_text())
    init = next(n for n in ast.walk(tree)
                if isinstance(n, ast.FunctionDef) and n.name == "_init_state")
    return {n.attr for n in ast.walk(init) if isinstance(n, ast.Attribute)
            and isinstance(n.value, ast.Name) and n.value.id == "self"
            and isinstance(n.ctx, ast.Store)}


def _foreign_reads(tree: ast.AST, names: set[str]) -> list[tuple[int, str]]:
    """(line, code) of every ``x.<name>`` with ``x`` not ``self`` / ``cls``, and every
    ``getattr`` / ``setattr`` / ``hasattr`` / ``delattr`` naming one by string."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in names and not (
                isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
            found.append((node.lineno, ast.unparse(node)))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id in ("getattr", "setattr", "hasattr", "delattr") \
                and len(node.args) > 1 and isinstance(node.args[1], ast.Constant) \
                and node.args[1].value in names:
            found.append((node.lineno, ast.unparse(node)))
    return found


def test_no_module_reads_the_executors_state():
    names = _executor_state() | FORMER_STATE
    assert {"_compiled", "_options", "_model"} <= names  # the reader found _init_state
    bad = []
    for name, path in _modules().items():
        if name == EXECUTOR_MODULE:
            continue
        bad += [f"{name}:{line}: {code}" for line, code in
                _foreign_reads(ast.parse(path.read_text()), names)]
    assert not bad, ("only PoplarExecutor reads its own state: hand the Compilation (or "
                     "the piece needed) and the user-facing values to other modules "
                     "explicitly:\n" + "\n".join(bad))


def test_the_state_reader_sees_foreign_reads():
    """So that the test above cannot pass by finding nothing."""
    tree = ast.parse("def f(executor, self):\n    executor._program.run()\n"
                     "    getattr(executor, '_compiled')\n    self._program = 1\n")
    assert sorted(line for line, _ in _foreign_reads(tree, {"_program", "_compiled"})) \
        == [2, 3]


# -- the engine reads the options as compiled (RuntimeConfig), not the Options object ---
OPTION_GROUPS = {"Training", "Precision", "TensorLocations", "Distributed", "Jit",
                 "_Popart", "execution_strategy", "_execution_strategy"}
OPTIONS_READERS = {"poptorch._runtime.config"}  # RuntimeConfig.of: made at compile time


def _option_group_reads(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, code) of every read of an ``Options`` sub-object (``x.Training``, ...)."""
    return [(node.lineno, ast.unparse(node)) for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and node.attr in OPTION_GROUPS]


def test_the_engine_reads_the_runtime_config():
    bad = []
    for name, path in _modules().items():
        if not name.startswith(ENGINE + ".") or name in OPTIONS_READERS:
            continue
        bad += [f"{name}:{line}: {code}" for line, code in
                _option_group_reads(ast.parse(path.read_text()))]
    assert not bad, ("the engine reads the options as compiled "
                     "(poptorch._runtime.config.RuntimeConfig, made once at compile "
                     "time); add what it needs there:\n" + "\n".join(bad))


def test_the_option_reader_sees_reads():
    """So that the test above cannot pass by finding nothing."""
    tree = ast.parse("def f(options, config):\n    config.precision.partials_type\n"
                     "    return options.Precision.partials_type\n")
    assert [line for line, _ in _option_group_reads(tree)] == [3]
