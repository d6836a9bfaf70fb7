"""Test helpers (``import poptorch.testing``): compare results with a reference."""
from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["allclose"]

# (rtol, atol) by dtype, for the lower-precision side of a comparison.
_TOLERANCES = {
    torch.float16: (1e-3, 1e-5),
    torch.bfloat16: (1.6e-2, 1e-5),
    torch.float32: (1.3e-6, 1e-5),
    torch.float64: (1e-7, 1e-7),
}


def _tensors_close(ref: torch.Tensor, other: torch.Tensor) -> bool:
    if ref.shape != other.shape:
        return False
    other = other.to(ref.device)
    if not (ref.is_floating_point() or other.is_floating_point()
            or ref.is_complex() or other.is_complex()):
        return bool(torch.equal(ref, other.to(ref.dtype)))
    precisions = [t.dtype for t in (ref, other) if t.dtype in _TOLERANCES]
    rtol, atol = max((_TOLERANCES[d] for d in precisions), default=_TOLERANCES[torch.float32])
    common = torch.promote_types(ref.dtype, other.dtype)
    return bool(torch.allclose(ref.to(common), other.to(common), rtol=rtol, atol=atol,
                               equal_nan=True))


def allclose(ref: Any, other: Any) -> bool:
    """True when ``other`` matches the reference ``ref``.

    Both may be nested tuples, lists and dicts of tensors, numbers and other values;
    the structures must match exactly (same container kinds, lengths and keys).
    Tensors must have the same shape and be close with tolerances set by the less
    precise of the two dtypes (NaNs compare equal); integer and bool tensors must be
    equal. Numbers are compared with the float32 tolerances; other values with ``==``.
    """
    if isinstance(ref, torch.Tensor) or isinstance(other, torch.Tensor):
        return isinstance(ref, torch.Tensor) and isinstance(other, torch.Tensor) \
            and _tensors_close(ref, other)
    if isinstance(ref, (list, tuple)):
        return isinstance(other, (list, tuple)) and isinstance(other, tuple) == \
            isinstance(ref, tuple) and len(ref) == len(other) and \
            all(allclose(r, o) for r, o in zip(ref, other, strict=False))
    if isinstance(ref, dict):
        return isinstance(other, dict) and ref.keys() == other.keys() and \
            all(allclose(ref[k], other[k]) for k in ref)
    if isinstance(ref, (int, float)) and not isinstance(ref, bool) and \
            isinstance(other, (int, float)) and not isinstance(other, bool):
        rtol, atol = _TOLERANCES[torch.float32]
        return (math.isnan(ref) and math.isnan(other)) or \
            math.isclose(ref, other, rel_tol=rtol, abs_tol=atol)
    return ref == other
