"""Safe evaluation of the arguments in options config files (no ``eval``)."""
from __future__ import annotations

import ast
from typing import Any

import torch

from .. import enums
from ..annotations import strategies
from .store import OptionsDict
from .tensor_locations import TensorLocationSettings


def dotted_name(node: ast.AST) -> list[str] | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(node.id)
    return parts[::-1]


def _resolve_constant(path: list[str]) -> Any:
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


def safe_value(node: ast.AST) -> Any:
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
