"""``module_repr`` and ``print``: a module's repr showing its BeginBlock annotations."""
from __future__ import annotations

import builtins

import torch

from ..annotations.blocks import begin_block_of

__all__ = ["module_repr", "print"]


def _indent(text: str, spaces: int) -> str:
    lines = text.split("\n")
    return "\n".join(lines[:1] + [" " * spaces + line for line in lines[1:]])


def _block_mark(module: torch.nn.Module) -> str:
    block = begin_block_of(module)
    if block is None:
        return ""
    return f"BeginBlock(user_id={block.user_id!r}, ipu_id={block.ipu_id!r}) "


def module_repr(m: torch.nn.Module) -> str:
    """``repr(m)`` with each layer annotated by :py:func:`poptorch.BeginBlock` (``m``
    itself included) prefixed by ``BeginBlock(user_id=..., ipu_id=...)``, as PopTorch
    prints it; identical to ``repr(m)`` otherwise."""
    if not isinstance(m, torch.nn.Module):
        raise TypeError(f"module_repr expects a torch.nn.Module, got {type(m).__name__}.")
    extra = m.extra_repr()
    lines = extra.split("\n") if extra else []
    for name, child in m._modules.items():
        if child is None:
            continue
        lines.append(f"({name}): " + _indent(module_repr(child), 2))
    head = _block_mark(m) + m._get_name() + "("
    if not lines:
        return head + ")"
    if len(lines) == 1 and not m._modules:
        return head + lines[0] + ")"
    return head + "\n  " + "\n  ".join(lines) + "\n)"


def print(m: object) -> None:
    """Print a module with its block annotations (:py:func:`module_repr`); any other
    object is printed as the built-in ``print`` does."""
    if isinstance(m, torch.nn.Module):
        builtins.print(module_repr(m))
    else:
        builtins.print(m)
