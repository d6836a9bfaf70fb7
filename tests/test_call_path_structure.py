"""The call path stays one path, measured on the source (``ast``): the device program is
built once and only its own module assigns to it, ``PoplarExecutor.__call__`` stays a
short prepare / run / finish, and no module reaches into another object's ``__dict__``
(docs/design.md, "One call path")."""
from __future__ import annotations

import ast
import pathlib

SRC = pathlib.Path(__file__).resolve().parent.parent / "src" / "poptorch"
PROGRAM_MODULE = "_runtime/program/device_loop.py"
CALL_LINES = 40


def _modules():
    for path in sorted(SRC.rglob("*.py")):
        yield path.relative_to(SRC).as_posix(), ast.parse(path.read_text())


def _targets(node: ast.AST) -> list[ast.AST]:
    if isinstance(node, ast.Assign):
        return list(node.targets)
    if isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        return [node.target]
    return []


def _program_attribute_writes(tree: ast.AST) -> list[tuple[int, str]]:
    """Assignments to an attribute of something named ``program`` / ``_program``
    (``program.x = ...``, ``compiled.program.x = ...``, ``self._program.x = ...``)."""
    found = []
    for node in ast.walk(tree):
        for target in _targets(node):
            for element in ast.walk(target):
                if not isinstance(element, ast.Attribute):
                    continue
                owner = element.value
                name = owner.id if isinstance(owner, ast.Name) else \
                    owner.attr if isinstance(owner, ast.Attribute) else None
                if name in ("program", "_program", "_executable"):
                    found.append((node.lineno, ast.unparse(target)))
    return found


def test_nothing_outside_its_module_assigns_to_the_device_program():
    bad = [f"{rel}:{line}: {text}" for rel, tree in _modules() if rel != PROGRAM_MODULE
           for line, text in _program_attribute_writes(tree)]
    assert not bad, "the device program is built once from its spec:\n" + "\n".join(bad)


def test_the_reader_sees_program_writes():
    tree = ast.parse("program.runner = 1\ncompiled.program.compiled = 2\n"
                     "self._program.x += 1\nprogram.perf.synthetic = True\n")
    assert len(_program_attribute_writes(tree)) == 4


def test_the_executor_call_is_short():
    """``__call__`` (and ``_call``, its body under PopTorch Geometric's substitutions):
    prepare / run under one undo guard / finish."""
    tree = ast.parse((SRC / "executor" / "poplar_executor.py").read_text())
    calls = {n.name: n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)
             and n.name in ("__call__", "_call")}
    assert "__call__" in calls
    for name, node in calls.items():
        lines = node.end_lineno - node.lineno + 1
        assert lines <= CALL_LINES, f"PoplarExecutor.{name} has {lines} lines"


def _dict_reach_ins(tree: ast.AST) -> list[tuple[int, str]]:
    """``x.__dict__`` and ``vars(x)`` for any ``x`` other than ``self`` / ``cls``."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "__dict__":
            owner = node.value
            if not (isinstance(owner, ast.Name) and owner.id in ("self", "cls")):
                found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id == "vars" and node.args:
            owner = node.args[0]
            if not (isinstance(owner, ast.Name) and owner.id in ("self", "cls")):
                found.append((node.lineno, ast.unparse(node)))
    return found


ATTRIBUTE_TABLE_MODULE = "_runtime/attributes.py"  # attribute_table: the one reader


def test_no_module_reaches_into_another_objects_dict():
    bad = [f"{rel}:{line}: {text}" for rel, tree in _modules()
           if rel != ATTRIBUTE_TABLE_MODULE for line, text in _dict_reach_ins(tree)]
    assert not bad, ("keep state in a WeakKeyDictionary registry or a documented "
                     "attribute, read instance attributes with "
                     "poptorch._runtime.attributes:\n" + "\n".join(bad))


def test_the_reader_sees_dict_reach_ins():
    tree = ast.parse("a = m.__dict__['x']\nb = vars(m)\nc = self.__dict__\nd = vars(cls)\n")
    assert len(_dict_reach_ins(tree)) == 2
