"""``serializedMatMul``: a matrix product computed as ``factor`` smaller products.

Upstream splits a large matmul so that the IPU never holds the whole working set. Here
the point is the same: every slice's product is written (or accumulated, in place)
into one output tensor allocated once, so no partial result the size of the output
and no concatenation ever exist. The backward pass (a custom autograd Function) is
serialized the same way: each gradient is allocated once and filled or accumulated
slice by slice. The peak memory is therefore never above the plain matmul's (the
output and gradients themselves are the lower bound), and is below it where a plain
matmul materialises a broadcast gradient (a 2-D ``lhs`` times a batched ``rhs``).

For ``lhs`` (m x n) times ``rhs`` (n x p):

* ``InputChannels`` splits m: output rows ``C[r] = A[r] @ B``;
* ``ReducingDim`` splits n: ``C = sum_k A[:, k] @ B[k, :]`` accumulated in place;
* ``OutputChannels`` splits p: output columns ``C[:, c] = A @ B[:, c]``.

Batched operands broadcast as in ``torch.matmul``; each batch entry is one 2-D
problem (operands are indexed, never expanded into copies). With float16 operands and
``keep_precision``, every accumulation across slices happens in float32.
"""
from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import torch

from ..enums import MatMulSerializationMode
from ..errors import Error

__all__ = ["serializedMatMul"]

_Mode = MatMulSerializationMode


def _chunks(length: int, factor: int, what: str) -> list[slice]:
    if length % factor:
        raise Error(f"serializedMatMul: factor={factor} must divide the {what} "
                    f"dimension (size {length}).")
    step = length // factor
    return [slice(i, i + step) for i in range(0, length, step)]


def _mm_(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, accumulate: bool) -> None:
    """``out (+)= a @ b`` in place (2-D), casting slices to ``out``'s dtype if needed."""
    if a.dtype != out.dtype:
        a = a.to(out.dtype)
    if b.dtype != out.dtype:
        b = b.to(out.dtype)
    out.addmm_(a, b, beta=1 if accumulate else 0)


def _product_2d(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, mode: _Mode,
                factor: int, acc_dtype: torch.dtype | None) -> None:
    """``out = a @ b`` for 2-D operands, serialized along ``mode``'s dimension."""
    m, n = a.shape
    p = b.shape[1]
    if mode == _Mode.InputChannels:
        for r in _chunks(m, factor, "input channels (m)"):
            _mm_(out[r], a[r], b, False)
    elif mode == _Mode.OutputChannels:
        for c in _chunks(p, factor, "output channels (p)"):
            _mm_(out[:, c], a, b[:, c], False)
    else:
        acc = out if acc_dtype is None else torch.empty(out.shape, dtype=acc_dtype,
                                                        device=out.device)
        for i, k in enumerate(_chunks(n, factor, "reducing (n)")):
            _mm_(acc, a[:, k], b[k], i > 0)
        if acc is not out:
            out.copy_(acc)


def _grads_2d(a: torch.Tensor, b: torch.Tensor, g: torch.Tensor, ga: torch.Tensor | None,
              gb: torch.Tensor | None, mode: _Mode, factor: int,
              acc_dtype: torch.dtype | None, ga_started: bool, gb_started: bool) -> None:
    """Accumulate (or write) ``ga += g @ b^T`` and ``gb += a^T @ g`` slice by slice.

    ``ga``/``gb`` may be None (no gradient needed). ``*_started``: whether the gradient
    already holds a contribution to add to (broadcast batches)."""
    m, n = a.shape
    p = b.shape[1]
    if mode == _Mode.ReducingDim:
        for k in _chunks(n, factor, "reducing (n)"):
            if ga is not None:
                _mm_(ga[:, k], g, b[k].t(), ga_started)
            if gb is not None:
                _mm_(gb[k], a[:, k].t(), g, gb_started)
        return
    if mode == _Mode.InputChannels:
        rows = _chunks(m, factor, "input channels (m)")
        if ga is not None:
            for r in rows:
                _mm_(ga[r], g[r], b.t(), ga_started)
        if gb is not None:
            _accumulate(gb, [(a[r].t(), g[r]) for r in rows], gb_started, acc_dtype)
        return
    cols = _chunks(p, factor, "output channels (p)")
    if gb is not None:
        for c in cols:
            _mm_(gb[:, c], a.t(), g[:, c], gb_started)
    if ga is not None:
        _accumulate(ga, [(g[:, c], b[:, c].t()) for c in cols], ga_started, acc_dtype)


def _accumulate(out: torch.Tensor, pairs: list[tuple[torch.Tensor, torch.Tensor]],
                started: bool, acc_dtype: torch.dtype | None) -> None:
    """``out (+)= sum(x @ y for x, y in pairs)`` in place (in ``acc_dtype`` if set)."""
    if acc_dtype is None:
        for i, (x, y) in enumerate(pairs):
            _mm_(out, x, y, started or i > 0)
        return
    acc = out.to(acc_dtype) if started else torch.empty(out.shape, dtype=acc_dtype,
                                                        device=out.device)
    for i, (x, y) in enumerate(pairs):
        _mm_(acc, x, y, started or i > 0)
    out.copy_(acc)


def _batch_index(index: tuple, shape: torch.Size) -> tuple:
    """The entry of an operand with batch ``shape`` used by broadcast batch ``index``."""
    offset = len(index) - len(shape)
    return tuple(0 if size == 1 else index[offset + i] for i, size in enumerate(shape))


def _pairs(a: torch.Tensor, b: torch.Tensor, batch: torch.Size
           ) -> Iterator[tuple[tuple, tuple, tuple]]:
    """(batch index, a entry index, b entry index) of every 2-D sub-problem."""
    for index in itertools.product(*(range(s) for s in batch)):
        yield index, _batch_index(index, a.shape[:-2]), _batch_index(index, b.shape[:-2])


class _SerializedMatMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor, mode: _Mode, factor: int,
                acc_dtype: torch.dtype | None) -> torch.Tensor:
        batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
        m, p = a.shape[-2], b.shape[-1]
        out = torch.empty((*batch, m, p), dtype=a.dtype, device=a.device)
        if b.dim() == 2 and a.dim() > 2 and a.is_contiguous():
            # Fold the batch into the rows: one 2-D problem (a view, no copy).
            _product_2d(a.reshape(-1, a.shape[-1]), b, out.view(-1, p), mode, factor,
                        acc_dtype)
        else:
            for index, ia, ib in _pairs(a, b, batch):
                _product_2d(a[ia], b[ib], out[index], mode, factor, acc_dtype)
        ctx.save_for_backward(a, b)
        ctx.config = (mode, factor, acc_dtype, batch)
        return out

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        a, b = ctx.saved_tensors
        mode, factor, acc_dtype, batch = ctx.config
        need_a, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        ga = torch.empty_like(a, memory_format=torch.contiguous_format) if need_a else None
        gb = torch.empty_like(b, memory_format=torch.contiguous_format) if need_b else None
        g = g.contiguous()
        if b.dim() == 2 and a.dim() > 2 and a.is_contiguous():
            n, p = a.shape[-1], b.shape[-1]
            _grads_2d(a.reshape(-1, n), b, g.view(-1, p),
                      None if ga is None else ga.view(-1, n), gb, mode, factor,
                      acc_dtype, False, False)
        else:
            started_a, started_b = set(), set()
            for index, ia, ib in _pairs(a, b, batch):
                _grads_2d(a[ia], b[ib], g[index], None if ga is None else ga[ia],
                          None if gb is None else gb[ib], mode, factor, acc_dtype,
                          ia in started_a, ib in started_b)
                started_a.add(ia)
                started_b.add(ib)
        return ga, gb, None, None, None


def serializedMatMul(lhs: torch.Tensor, rhs: torch.Tensor, mode: MatMulSerializationMode,
                     factor: int = 0, keep_precision: bool = False) -> torch.Tensor:
    """``torch.matmul(lhs, rhs)`` computed as ``factor`` smaller products.

    For ``lhs`` (m by n) times ``rhs`` (n by p), ``mode`` picks the dimension split:
    ``InputChannels`` (m), ``ReducingDim`` (n) or ``OutputChannels`` (p);
    ``Disabled`` is an ordinary matmul. The slices are written or accumulated in place
    into one output (and likewise for the gradients), so peak memory never exceeds the
    plain matmul's. With float16 inputs and ``keep_precision``, accumulations across
    slices run in float32.
    """
    if not isinstance(mode, MatMulSerializationMode):
        raise Error(f"serializedMatMul: mode must be a poptorch.MatMulSerializationMode, "
                    f"got {mode!r}.")
    if not isinstance(lhs, torch.Tensor) or not isinstance(rhs, torch.Tensor):
        raise Error("serializedMatMul: lhs and rhs must be tensors.")
    if lhs.dim() < 2 or rhs.dim() < 2:
        raise Error("serializedMatMul: lhs and rhs must have at least 2 dimensions, got "
                    f"shapes {tuple(lhs.shape)} and {tuple(rhs.shape)}.")
    if mode == MatMulSerializationMode.Disabled:
        return torch.matmul(lhs, rhs)
    if not isinstance(factor, int) or isinstance(factor, bool) or factor < 1:
        raise Error(f"serializedMatMul: factor must be an int >= 1 when mode is {mode}, "
                    f"got {factor!r}.")
    if lhs.shape[-1] != rhs.shape[-2]:
        raise Error(f"serializedMatMul: shapes {tuple(lhs.shape)} and {tuple(rhs.shape)} "
                    "cannot be multiplied (lhs's last dimension must equal rhs's "
                    "second-to-last).")
    if lhs.dtype != rhs.dtype:
        raise Error(f"serializedMatMul: lhs is {lhs.dtype} and rhs is {rhs.dtype}; cast "
                    "one of them so that both have the same dtype.")
    if not lhs.is_floating_point():
        raise Error(f"serializedMatMul: expected floating-point operands, got {lhs.dtype}.")
    try:
        torch.broadcast_shapes(lhs.shape[:-2], rhs.shape[:-2])
    except RuntimeError:
        raise Error(f"serializedMatMul: the batch dimensions of {tuple(lhs.shape)} and "
                    f"{tuple(rhs.shape)} do not broadcast.") from None
    wide = keep_precision and lhs.dtype in (torch.float16, torch.bfloat16)
    return _SerializedMatMul.apply(lhs, rhs, mode, factor, torch.float32 if wide else None)
