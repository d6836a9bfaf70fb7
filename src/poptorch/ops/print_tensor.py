"""``ipu_print_tensor``: an identity op that prints a tensor and, later, its gradient."""
from __future__ import annotations

import builtins
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .._runtime.torch_internals import disable_dynamo
from ..errors import Error

__all__ = ["format_tensor", "ipu_print_tensor"]

_FLOAT_FORMATS = ("auto", "fixed", "scientific", "none")


@dataclass(frozen=True)
class _Style:
    summarise_threshold: int
    edge_items: int
    max_line_width: int
    digits: int
    float_format: str
    separator: str
    open_bracket: str
    close_bracket: str


def _float_mode(values: torch.Tensor, style: _Style) -> str:
    """"fixed" or "scientific" for "auto": scientific when magnitudes span too far."""
    if style.float_format != "auto":
        return style.float_format
    finite = values[torch.isfinite(values)].abs()
    finite = finite[finite > 0]
    if finite.numel() == 0:
        return "fixed"
    big, small = finite.max().item(), finite.min().item()
    return "scientific" if big >= 1e8 or small < 1e-4 or big / small > 1e6 else "fixed"


def _element_formatter(values: torch.Tensor, style: _Style) -> Callable[[float], str]:
    """A function turning one Python number into its aligned text."""
    if values.is_floating_point():
        mode = _float_mode(values, style)
        digits = style.digits if style.digits > 0 else 6

        def fmt(v: float) -> str:
            if not math.isfinite(v):
                return str(v)
            if mode == "fixed":
                return f"{v:.{digits}f}"
            if mode == "scientific":
                return f"{v:.{digits}e}"
            return f"{v:g}"
    elif values.dtype == torch.bool:
        def fmt(v: float) -> str:
            return str(bool(v))
    else:
        def fmt(v: float) -> str:
            return str(int(v))
    if style.digits == 0 or style.float_format == "none" or values.numel() == 0:
        return fmt  # unaligned
    width = max(len(fmt(v)) for v in values.flatten().tolist())
    return lambda v: fmt(v).rjust(width)


def _shown(tensor: torch.Tensor, summarise: bool, edge: int) -> torch.Tensor:
    """The elements that will be printed (edges only when summarising)."""
    if not summarise or tensor.dim() == 0:
        return tensor.flatten()
    for dim in range(tensor.dim()):
        if tensor.shape[dim] > 2 * edge:
            keep = list(range(edge)) + list(range(tensor.shape[dim] - edge, tensor.shape[dim]))
            tensor = tensor.index_select(dim, torch.tensor(keep))
    return tensor.flatten()


def _wrap(items: list[str], style: _Style, indent: int) -> str:
    """Join ``items`` with the separator, splitting lines longer than the limit."""
    if style.max_line_width <= 0:
        return style.separator.join(items)
    sep = style.separator.rstrip() or style.separator
    lines, line = [], ""
    for i, item in enumerate(items):
        piece = item + (sep if i < len(items) - 1 else "")
        candidate = line + (style.separator[len(sep):] if line else "") + piece
        if line and indent + len(candidate) > style.max_line_width:
            lines.append(line)
            line = piece
        else:
            line = candidate
    lines.append(line)
    return ("\n" + " " * indent).join(lines)


def _format(tensor: torch.Tensor, fmt: Callable[[float], str], style: _Style, summarise: bool,
            depth: int) -> str:
    if tensor.dim() == 0:
        return fmt(tensor.item())
    size = tensor.shape[0]
    edge = style.edge_items
    if summarise and size > 2 * edge:
        indices = [*list(range(edge)), None, *list(range(size - edge, size))]
    else:
        indices = list(range(size))
    if tensor.dim() == 1:
        items = ["..." if i is None else fmt(tensor[i].item()) for i in indices]
        return style.open_bracket + _wrap(items, style, depth + len(style.open_bracket)) \
            + style.close_bracket
    inner = ["..." if i is None else _format(tensor[i], fmt, style, summarise, depth + 1)
             for i in indices]
    joiner = style.separator.rstrip() + "\n" + " " * (depth + len(style.open_bracket))
    return style.open_bracket + joiner.join(inner) + style.close_bracket


def format_tensor(tensor: torch.Tensor, summarise_threshold: int = 1000, edge_items: int = 3,
                  max_line_width: int = 80, digits: int = 4, float_format: str = "auto",
                  separator: str = ", ", open_bracket: str = "(",
                  close_bracket: str = ")") -> str:
    """Text of ``tensor`` in the layout ``ipu_print_tensor`` prints (see its arguments)."""
    style = _Style(summarise_threshold, edge_items, max_line_width, digits, float_format,
                   separator, open_bracket, close_bracket)
    values = tensor.detach().cpu()
    if values.is_complex():
        raise Error("ipu_print_tensor: complex tensors are not supported.")
    if values.is_floating_point():
        values = values.double()
    summarise = summarise_threshold > 0 and values.numel() > summarise_threshold
    fmt = _element_formatter(_shown(values, summarise, edge_items), style)
    return _format(values, fmt, style, summarise, 0)


class _PrintTensor(torch.autograd.Function):
    """Identity whose forward prints the value and backward prints the gradient."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, title: str, print_gradient: bool,
                style: dict[str, Any]) -> torch.Tensor:
        ctx.title, ctx.print_gradient, ctx.style = title, print_gradient, style
        _emit(title, tensor, style)
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        if ctx.print_gradient:
            _emit(f"{ctx.title}_gradient" if ctx.title else "gradient", grad, ctx.style)
        return grad, None, None, None


@disable_dynamo  # host work: keep the compiler out (imports torch._dynamo lazily)
def _emit(title: str, tensor: torch.Tensor, style: dict) -> None:
    text = format_tensor(tensor, **style)
    builtins.print(f"{title}: {text}" if title else text, flush=True)


def ipu_print_tensor(tensor: torch.Tensor, title: str = '', print_gradient: bool = True,
                     summarise_threshold: int = 1000, edge_items: int = 3,
                     max_line_width: int = 80, digits: int = 4, float_format: str = 'auto',
                     separator: str = ', ', open_bracket: str = '(',
                     close_bracket: str = ')') -> torch.Tensor:
    """Print ``tensor`` (to stdout) and return it unchanged; use the returned tensor.

    The value is printed as ``"<title>: <tensor>"`` when the op runs; in the backward
    pass, with ``print_gradient``, the gradient is printed as ``"<title>_gradient:
    <tensor>"``. Tensors with more than ``summarise_threshold`` elements (0: never) show
    only ``edge_items`` at each end of every dimension. Lines are split at
    ``max_line_width`` characters (0: never). Floats use ``digits`` digits after the
    point in ``float_format`` "fixed", "scientific", "auto" (chosen from the values) or
    "none" (each value on its own, unaligned); ``digits=0`` disables alignment.
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"ipu_print_tensor expects a torch.Tensor, got {type(tensor).__name__}.")
    if float_format not in _FLOAT_FORMATS:
        raise Error(f"ipu_print_tensor: float_format must be one of {_FLOAT_FORMATS}, "
                    f"got {float_format!r}.")
    for name, value in (("summarise_threshold", summarise_threshold),
                        ("edge_items", edge_items), ("max_line_width", max_line_width),
                        ("digits", digits)):
        if not isinstance(value, int) or value < 0:
            raise Error(f"ipu_print_tensor: {name} must be an int >= 0, got {value!r}.")
    style = {"summarise_threshold": summarise_threshold, "edge_items": edge_items,
                 "max_line_width": max_line_width, "digits": digits,
                 "float_format": float_format, "separator": separator,
                 "open_bracket": open_bracket, "close_bracket": close_bracket}
    return _PrintTensor.apply(tensor, str(title), bool(print_gradient), style)
