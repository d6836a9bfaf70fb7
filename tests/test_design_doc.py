"""docs/design.md stays true to the code, both ways.

* every path the page names in backticks (ending in ``.py`` or ``/``) exists: relative to
  ``src/poptorch/``, or to the repository for paths that start with one of its top-level
  folders (``tests/``, ``benchmarks/``, ...);
* every module of ``src/poptorch/_runtime/`` is named (a package by its folder), so the
  module map cannot fall behind the code;
* a module map entry (``- `path.py`: `Name`, `other`: ...``) lists first names the module
  defines, so a renamed class fails here, by name;
* each row of the contracts table names a ``Protocol``, a frozen dataclass or an
  ``Enum`` that its module defines.

Reads the page and the source with ``re`` and ``ast``: nothing of the package is imported.
"""
from __future__ import annotations

import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "src" / "poptorch"
ENGINE = PACKAGE / "_runtime"
DOC = ROOT / "docs" / "design.md"
# First components of paths that are relative to the repository, not to src/poptorch/.
REPOSITORY_FOLDERS = {"tests", "benchmarks", "scripts", "docs", "src", "compat", "examples",
                      ".ci"}
# The contracts the design names (issue 37); the table must keep them.
REQUIRED_CONTRACTS = {"StepRunner", "Compute", "GradientSync", "CrossProcess", "Backend",
                      "ProgramSpec", "RuntimeConfig"}

FENCE = re.compile(r"^```.*?^```[ \t]*$", re.S | re.M)
SPAN = re.compile(r"`([^`\n]+)`")
PATH = re.compile(r"[\w.-]+(/[\w.-]+)*/?")
ITEM = re.compile(r"^- `([\w./-]+\.py)`: (.*)$")
LEADING_NAME = re.compile(r"`(\w+)`(, )?")
ROW = re.compile(r"^\| `(\w+)` \| `([\w./-]+\.py)` \| (.*) \|$", re.M)


def prose(text: str) -> str:
    """The page without its fenced blocks (diagrams, code): what it names in backticks."""
    return FENCE.sub("", text)


def named_paths(text: str) -> set[str]:
    """Every backticked path ending in ``.py`` or ``/`` outside fenced blocks."""
    return {span for span in SPAN.findall(prose(text))
            if PATH.fullmatch(span) and (span.endswith(".py") or span.endswith("/"))}


def location(path: str) -> pathlib.Path | None:
    """Where ``path`` as written on the page is; None for paths outside the repository."""
    if path.startswith("../"):
        return None
    first = path.split("/", 1)[0]
    if "/" in path.rstrip("/") and first in REPOSITORY_FOLDERS:
        return ROOT / path
    return PACKAGE / path


def map_entries(text: str) -> list[tuple[str, list[str]]]:
    """(module path, names listed first) of each module map item, continuation lines
    joined: ``- `a/b.py`: `X`, `y`: text`` gives ``("a/b.py", ["X", "y"])``."""
    items: list[str] = []
    for line in prose(text).splitlines():
        if line.startswith("- "):
            items.append(line)
        elif line.startswith("  ") and items and line.strip():
            items[-1] += " " + line.strip()
        else:
            items.append("")
    entries = []
    for item in items:
        match = ITEM.match(item)
        if match is None:
            continue
        rest, names = match.group(2), []
        while (name := LEADING_NAME.match(rest)) is not None:
            names.append(name.group(1))
            if not name.group(2):
                break
            rest = rest[name.end():]
        entries.append((match.group(1), names))
    return entries


def engine_modules() -> set[str]:
    """How the page must name each module of ``_runtime/``: its path, or for a package's
    ``__init__.py`` its folder (``_runtime/schedule/``)."""
    names = set()
    for path in ENGINE.rglob("*.py"):
        relative = path.relative_to(PACKAGE)
        names.add(relative.parent.as_posix() + "/" if path.name == "__init__.py"
                  else relative.as_posix())
    return names


def _decorated_frozen(node: ast.ClassDef) -> bool:
    for decorator in node.decorator_list:
        if isinstance(decorator, ast.Call) and ast.unparse(decorator.func).endswith("dataclass"):
            for keyword in decorator.keywords:
                if keyword.arg == "frozen" and isinstance(keyword.value, ast.Constant) \
                        and keyword.value.value is True:
                    return True
    return False


def definitions(module: pathlib.Path) -> dict[str, ast.AST]:
    """The names ``module`` defines at its top level (classes, functions, assignments)."""
    found: dict[str, ast.AST] = {}
    for node in ast.parse(module.read_text(), str(module)).body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            found[node.name] = node
        elif isinstance(node, ast.Assign):
            found.update((t.id, node) for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            found[node.target.id] = node
    return found


def contract_kind(node: ast.AST) -> str | None:
    """"protocol", "frozen dataclass" or "enum" for a class node, else None."""
    if not isinstance(node, ast.ClassDef):
        return None
    bases = {ast.unparse(b).rsplit(".", 1)[-1] for b in node.bases}
    if "Protocol" in bases:
        return "protocol"
    if _decorated_frozen(node):
        return "frozen dataclass"
    if bases & {"Enum", "IntEnum", "StrEnum"}:
        return "enum"
    return None


@pytest.fixture(scope="module")
def doc() -> str:
    return DOC.read_text()


# -- the page's paths exist, and the engine's modules are all on it ----------------------
def test_every_named_path_exists(doc):
    missing = sorted(path for path in named_paths(doc)
                     if (where := location(path)) is not None and not where.exists())
    assert not missing, ("docs/design.md names paths that do not exist (paths are relative "
                         "to src/poptorch/): " + ", ".join(missing))


def test_every_engine_module_is_named(doc):
    unnamed = sorted(engine_modules() - named_paths(doc))
    assert not unnamed, ("modules of src/poptorch/_runtime/ missing from docs/design.md's "
                         "module map (one line each): " + ", ".join(unnamed))


def test_map_entries_name_what_their_module_defines(doc):
    entries = map_entries(doc)
    assert len(entries) >= len(engine_modules()) // 2  # the reader found the map
    bad = []
    for path, names in entries:
        module = location(path)
        if module is None or not module.is_file():
            continue  # (reported by test_every_named_path_exists)
        defined = definitions(module)
        bad += [f"{path}: {name}" for name in names if name not in defined]
    assert not bad, ("docs/design.md's module map lists names these modules do not "
                     "define: " + ", ".join(bad))


def test_contracts_are_protocols_frozen_dataclasses_or_enums(doc):
    rows = ROW.findall(prose(doc))
    lost = REQUIRED_CONTRACTS - {name for name, _, _ in rows}
    assert not lost, "the contracts table lost " + ", ".join(sorted(lost))
    bad = []
    for name, path, promise in rows:
        module = location(path)
        assert module is not None and module.is_file(), path
        kind = contract_kind(definitions(module).get(name, ast.Pass()))
        if kind is None:
            bad.append(f"{name} ({path}): not a Protocol, frozen dataclass or Enum there")
        elif "frozen" in promise and kind != "frozen dataclass":
            bad.append(f"{name} ({path}): the page says frozen, the code is a {kind}")
    assert not bad, "\n".join(bad)


# -- the readers find what they look for (so the tests above cannot pass on nothing) -----
def test_the_readers_see_paths_names_and_rows():
    text = ("A `_runtime/x.py` and `tests/t.py`, `_runtime/y/`, `../shared/A.md`, "
            "`model.schedule`, `a b.py`.\n```text\n`_runtime/in_a_diagram.py`\n```\n"
            "- `_runtime/z.py`: `Alpha`, `beta`: text `Gamma`\n"
            "- `_runtime/w.py`: `Delta` (frozen), `Epsilon`\n"
            "- `_runtime/v.py`: `Zeta`,\n  `Eta`.\n"
            "| `Theta` | `_runtime/z.py` | frozen |\n")
    assert named_paths(text) == {"_runtime/x.py", "tests/t.py", "_runtime/y/",
                                 "_runtime/z.py", "_runtime/w.py", "_runtime/v.py"}
    assert location("tests/t.py") == ROOT / "tests" / "t.py"
    assert location("_runtime/y/") == PACKAGE / "_runtime" / "y"
    assert location("../shared/A.md") is None
    assert map_entries(text) == [("_runtime/z.py", ["Alpha", "beta"]),
                                 ("_runtime/w.py", ["Delta"]),
                                 ("_runtime/v.py", ["Zeta", "Eta"])]
    assert ROW.findall(text) == [("Theta", "_runtime/z.py", "frozen")]
    assert "_runtime/program/interpreter.py" in engine_modules()
    assert "_runtime/schedule/" in engine_modules()


def test_the_contract_reader_sees_kinds():
    tree = ast.parse("from dataclasses import dataclass\n"
                     "class P(typing.Protocol): ...\n"
                     "@dataclass(frozen=True, eq=False)\nclass F: ...\n"
                     "@dataclass\nclass M: ...\n"
                     "class E(str, enum.Enum): ...\n")
    kinds = [contract_kind(node) for node in tree.body[1:]]
    assert kinds == ["protocol", "frozen dataclass", None, "enum"]
