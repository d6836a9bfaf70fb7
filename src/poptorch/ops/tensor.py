"""Tensor ops: identity_loss, nop, dynamic slicing (and serializedMatMul, which lives in
``_ops_matmul.py``)."""
from __future__ import annotations

import torch

from .._runtime import context
from ..enums import ReductionType
from ..errors import Error
from .matmul import serializedMatMul

__all__ = ["dynamic_slice", "dynamic_update", "identity_loss", "nop", "serializedMatMul"]

# Upstream's integer reduction codes (the values of ``poptorch.ReductionType``).
_REDUCTIONS = {"sum": ReductionType.Sum, "mean": ReductionType.Mean,
               "none": ReductionType.NoReduction}


def _reduction_code(reduction: str | int) -> ReductionType:
    if isinstance(reduction, str) and reduction in _REDUCTIONS:
        return _REDUCTIONS[reduction]
    if isinstance(reduction, int) and not isinstance(reduction, bool):
        try:
            return ReductionType(reduction)
        except ValueError:
            pass
    raise Error(f"identity_loss: unsupported reduction {reduction!r}. Use 'sum', 'mean' or "
                "'none' (or upstream's codes 0, 1, 2 / poptorch.ReductionType).")


def identity_loss(x: torch.Tensor, reduction: str | int) -> torch.Tensor:
    """Reduce ``x`` like a PyTorch loss and mark the result as the model's loss.

    The executor starts back-propagation from the marked tensor (with ``"none"`` it
    back-propagates a gradient of ones). Outside an executor it simply returns the
    reduced value, so the same model also runs as plain PyTorch.

    Args:
        x: the calculated loss.
        reduction: ``"sum"``, ``"mean"`` or ``"none"``; upstream's integer codes
            ``0``/``1``/``2`` (``poptorch.ReductionType``) are accepted too.
    """
    if not isinstance(x, (torch.Tensor, torch.fx.Proxy)):  # (a Proxy: graph capture)
        raise TypeError(f"identity_loss expects a torch.Tensor, got {type(x).__name__}.")
    code = _reduction_code(reduction)
    if code == ReductionType.Sum:
        result = x.sum()
    elif code == ReductionType.Mean:
        result = x.mean()
    else:
        result = x.view_as(x)
    context.mark_loss(result)
    return result


def nop(tensor: torch.Tensor) -> torch.Tensor:
    """A no-operation that is never optimised away: returns a copy of ``tensor``.

    The copy is a real kernel, so it shows up in captured graphs and profiler traces,
    which is what makes it useful as a debugging marker.
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"nop expects a torch.Tensor, got {type(tensor).__name__}.")
    return tensor.clone()


def _check_dim(tensor: torch.Tensor, dim: int, op: str) -> int:
    if not isinstance(dim, int) or not -tensor.dim() <= dim < tensor.dim():
        raise Error(f"{op}: dim={dim!r} is out of range for a tensor with "
                    f"{tensor.dim()} dimensions.")
    return dim % tensor.dim()


def _check_static_int(value: object, name: str, op: str, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise Error(f"{op}: {name} must be a constant int >= {minimum}, got {value!r}.")


def _check_slice_size(size: object, op: str) -> None:
    """A slice covers at least one element: ``size`` is ``end - start`` of the slice."""
    if isinstance(size, int) and not isinstance(size, bool) and size <= 0:
        if size == 0:
            raise Error(f"{op}: The start and end of a slice must be different (size 0): "
                        f"an empty slice is not supported; pass a size >= 1.")
        raise Error(f"{op}: Taking a slice of a tensor with the end less than the start is "
                    f"not supported (size {size}); pass a size >= 1.")
    _check_static_int(size, "size", op, 1)


def _start_index(start: int | torch.Tensor, extent: int, dim_size: int, op: str
                 ) -> int | torch.Tensor:
    """``start`` as an index tensor (dynamic) or int (static), checked or clamped.

    Static starts are checked. Tensor starts are clamped into ``[0, dim_size - extent]``
    on the device, as Poplar's dynamic slice does, so no host synchronisation happens.
    """
    if isinstance(start, torch.Tensor):
        if start.numel() != 1 or start.is_floating_point() or start.is_complex():
            raise Error(f"{op}: a tensor start must hold one integer, got shape "
                        f"{tuple(start.shape)} and dtype {start.dtype}.")
        return start.reshape(()).long().clamp(0, dim_size - extent)
    if not isinstance(start, int) or isinstance(start, bool):
        raise TypeError(f"{op}: start must be an int or an integer tensor, got "
                        f"{type(start).__name__}.")
    if not 0 <= start <= dim_size - extent:
        raise Error(f"{op}: the slice [{start}, {start + extent}) does not fit in a "
                    f"dimension of size {dim_size}.")
    return start


def dynamic_slice(tensor: torch.Tensor, dim: int, start: int | torch.Tensor, size: int,
                  step: int) -> torch.Tensor:
    """Slice ``size`` elements from ``start`` along ``dim``, keeping every ``step``-th.

    Equivalent to ``tensor[..., start:start + size:step]`` on dimension ``dim``, but
    ``start`` may be a tensor (a dynamic offset, clamped into range on the device).
    """
    op = "dynamic_slice"
    dim = _check_dim(tensor, dim, op)
    _check_slice_size(size, op)
    _check_static_int(step, "step", op, 1)
    if isinstance(start, torch.Tensor) and context.is_running_on_ipu() \
            and tensor.shape[dim] % size:
        # PopTorch's rule for a slice at a tensor (dynamic) start, in a PopTorch model
        raise Error(f"{op}: The size of the slice ({size}) must be a factor of the slicing "
                    f"dimension ({tensor.shape[dim]}). Pick a size that divides it, or pad "
                    f"dimension {dim} to a multiple of {size}.")
    begin = _start_index(start, size, tensor.shape[dim], op)
    if isinstance(begin, int):
        return tensor.narrow(dim, begin, size)[(slice(None),) * dim + (slice(None, None, step),)]
    offsets = torch.arange(0, size, step, device=tensor.device)
    return tensor.index_select(dim, begin.to(tensor.device) + offsets)


def dynamic_update(input: torch.Tensor, src: torch.Tensor, dim: int, start: int | torch.Tensor,
                   size: int) -> torch.Tensor:
    """Return ``input`` with ``size`` elements from ``start`` along ``dim`` replaced by ``src``.

    ``input`` itself is not modified. ``start`` may be a tensor (clamped into range).
    """
    op = "dynamic_update"
    dim = _check_dim(input, dim, op)
    _check_slice_size(size, op)
    if src.dim() != input.dim():
        raise Error(f"{op}: input and src tensors must have same dimensionality. "
                    f"({input.dim()}) vs ({src.dim()})")
    if src.dtype != input.dtype:
        raise Error(f"{op}: input and src tensor must have same dtype. "
                    f"({input.dtype} vs {src.dtype}); convert src with .to({input.dtype}).")
    expected = list(input.shape)
    expected[dim] = size
    if list(src.shape) != expected:
        raise Error(f"{op}: src has shape {tuple(src.shape)}, expected {tuple(expected)} "
                    f"(input's shape with dimension {dim} of the slice size {size}).")
    begin = _start_index(start, size, input.shape[dim], op)
    if isinstance(begin, torch.Tensor):
        begin = begin.to(input.device)
    index = begin + torch.arange(size, device=input.device)
    return input.index_copy(dim, index, src)
