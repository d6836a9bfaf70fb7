"""Synthetic data (``Options.enableSyntheticData(True)``): no host-to-device input IO.

The device program runs on zeros of each input's shape and dtype, created on the device
once per input signature and reused, as the synthetic data mode of upstream's backend
does; the host tensors passed to the model are never read or transferred. This measures
compute without IO. Non-tensor arguments are passed through unchanged.
"""
from __future__ import annotations

from typing import Any

import torch
from ..torch_internals import pytree


class SyntheticInputs:
    """Replaces the tensors of a call's inputs by cached device zeros."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._cache: dict[Any, list] = {}

    def __call__(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        leaves, spec = pytree.tree_flatten((args, kwargs))
        key = (spec, tuple((t.shape, t.dtype) if isinstance(t, torch.Tensor) else None
                           for t in leaves))
        cached = self._cache.get(key)
        if cached is None:
            cached = [torch.zeros(t.shape, dtype=t.dtype, device=self.device)
                      if isinstance(t, torch.Tensor) else None for t in leaves]
            self._cache[key] = cached
        return pytree.tree_unflatten(
            [leaf if zero is None else zero for leaf, zero in zip(leaves, cached, strict=False)], spec)
