"""Applying options from text: config files (``Options.loadFromFile``) and JSON
(``Options.from_json``). Arguments are evaluated safely (``ast``, no ``eval``), and only
option setters can be called."""
from __future__ import annotations

import ast
from collections.abc import Callable

import torch

from .. import enums
from .._typing import OptionValue
from ..annotations import strategies
from ..errors import Error
from .jit import _JitOptions
from .store import OptionsDict
from .tensor_locations import TensorLocationSettings

SUB_OBJECTS = ("Training", "Precision", "TensorLocations", "Jit", "Distributed", "_Popart")
"""The option categories of ``Options`` (attributes holding options objects)."""

# Methods that are not setters: config files and JSON cannot call them.
_NOT_SETTERS = frozenset({"loadFromFile", "from_json", "clone", "toDict", "exists",
                          "checkIsFrozen", "defaultOutputMode", "update", "createOrSet",
                          "deleteIfExists"})


def resolve_setter(options: object, path: list[str]) -> Callable:
    """The setter method of ``options`` at ``path`` (e.g. ``["Training",
    "gradientAccumulation"]``); anything that is not a setter is an error."""
    target = options
    for part in path[:-1]:
        if part not in SUB_OBJECTS:
            raise Error(f"'{part}' is not an options category; use one of "
                        f"{', '.join(SUB_OBJECTS)}.")
        target = getattr(target, part)
    name = path[-1]
    if name.startswith("_") or name in _NOT_SETTERS or (
            name == "set" and isinstance(target, OptionsDict)):
        raise Error(f"'{'.'.join(path)}' is not an option setter.")
    if name == "backend" and isinstance(target, _JitOptions):
        return target._set_backend
    method = getattr(type(target), name, None)
    if not callable(method) or isinstance(method, property):
        raise Error(f"Unknown option setter '{'.'.join(path)}'.")
    return getattr(target, name)


def apply_command(options: object, text: str) -> None:
    """Apply one config file line, a setter call such as ``deviceIterations(4)``."""
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as exc:
        raise Error(f"not a valid Python expression ({exc.msg}).") from None
    call = tree.body
    if not isinstance(call, ast.Call):
        raise Error("expected a setter call such as deviceIterations(4).")
    path = dotted_name(call.func)
    if path is None:
        raise Error("expected a setter call such as deviceIterations(4).")
    if path[0] in ("options", "opts") and len(path) > 1:
        path = path[1:]
    setter = resolve_setter(options, path)
    args = [safe_value(arg) for arg in call.args]
    kwargs = {}
    for keyword in call.keywords:
        if keyword.arg is None:
            raise Error("**kwargs are not supported in config files.")
        kwargs[keyword.arg] = safe_value(keyword.value)
    setter(*args, **kwargs)


def dotted_name(node: ast.AST) -> list[str] | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(node.id)
    return parts[::-1]


def _resolve_constant(path: list[str]) -> OptionValue:
    """An enum member, enum class, torch dtype or TensorLocationSettings named by path."""
    if path[0] == "poptorch":
        path = path[1:]
        if path and path[0] == "enums":
            path = path[1:]
    if path and path[0] == "torch" and len(path) == 2:
        value = getattr(torch, path[1], None)
        if isinstance(value, torch.dtype):
            return value
        raise ValueError(f"torch.{path[1]} is not a torch dtype.")
    if path == ["TensorLocationSettings"]:
        return TensorLocationSettings
    if len(path) == 1 and path[0] in _CONSTRUCTORS:
        return _CONSTRUCTORS[path[0]]
    if len(path) == 2 and path[0] in enums.__all__:
        enum_type = getattr(enums, path[0])
        if path[1] in enum_type.__members__:
            return enum_type[path[1]]
    raise ValueError(f"unknown name {'.'.join(path)!r} (config files may use literals, "
                     f"enum members such as poptorch.OutputMode.All, torch dtypes, "
                     f"poptorch.TensorLocationSettings() and the execution strategies "
                     f"with their stages, e.g. poptorch.ShardedExecution()).")


# Classes whose constructors config files may call (with safe arguments), as upstream
# configuration expressions do: setExecutionStrategy(poptorch.ShardedExecution()).
_CONSTRUCTORS = {name: getattr(strategies, name) for name in (
    "ShardedExecution", "PipelinedExecution", "SerialPhasedExecution",
    "ParallelPhasedExecution", "Stage", "Phase")}


def safe_value(node: ast.AST) -> OptionValue:
    """Evaluate a config-file argument without ``eval``."""
    try:
        return ast.literal_eval(node)
    except ValueError:
        pass
    if isinstance(node, (ast.Attribute, ast.Name)):
        path = dotted_name(node)
        if path is not None:
            return _resolve_constant(path)
    if isinstance(node, ast.List):
        return [safe_value(e) for e in node.elts]
    if isinstance(node, ast.Tuple):
        return tuple(safe_value(e) for e in node.elts)
    if isinstance(node, ast.Dict) and None not in node.keys:
        return {safe_value(k): safe_value(v) for k, v in zip(node.keys, node.values, strict=False)
                if k is not None}  # (none is: checked above)
    if isinstance(node, ast.Call):
        func_path = dotted_name(node.func)
        constructor = _resolve_constant(func_path) if func_path is not None and \
            func_path[-1] in _CONSTRUCTORS else None
        if constructor is not None:
            return constructor(*[safe_value(a) for a in node.args],
                               **{k.arg: safe_value(k.value) for k in node.keywords
                                  if k.arg is not None})
    if isinstance(node, ast.Call) and not node.keywords:
        func_path = dotted_name(node.func)
        if func_path is not None and _resolve_constant(func_path) is TensorLocationSettings:
            if node.args:
                raise ValueError("TensorLocationSettings() takes no arguments here.")
            return TensorLocationSettings()
        if isinstance(node.func, ast.Attribute):
            receiver = safe_value(node.func.value)
            name = node.func.attr
            if isinstance(receiver, TensorLocationSettings) and not name.startswith("_") \
                    and hasattr(TensorLocationSettings, name) \
                    and name not in dir(OptionsDict):
                return getattr(receiver, name)(*[safe_value(a) for a in node.args])
    raise ValueError(f"unsupported expression {ast.unparse(node)!r}.")
