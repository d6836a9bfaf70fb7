"""Synthetic data (``Options.enableSyntheticData``): no host-to-device input IO.

The device program runs on data of each input's shape and dtype created on the device
once per input signature and reused call after call, as PopART's synthetic data modes
do; the host tensors passed to the model are never read or transferred. This measures
compute without IO. Non-tensor arguments are passed through unchanged.

The modes are PopART's ``SyntheticDataMode``: 1, zeros; 2, random normal (mean 0,
variance 1), what ``enableSyntheticData(True)`` selects. As in PopART, the random values
are drawn in float32 from a fixed seed (the same data every run) and converted to the
input's dtype: integer inputs get the truncated values (mostly 0, some of -2..2), so a
model indexing with an input (class labels) needs zeros instead.
"""
from __future__ import annotations

from typing import Any

import torch

from ..torch_internals import pytree

ZEROS = 1
RANDOM_NORMAL = 2
MODES = {ZEROS: "zeros", RANDOM_NORMAL: "random normal"}
_SEED = 0  # random normal data: fixed, as PopART's default-seeded generator


class SyntheticInputs:
    """Replaces the tensors of a call's inputs by cached device data of ``mode``."""

    def __init__(self, device: torch.device, mode: int = RANDOM_NORMAL) -> None:
        if mode not in MODES:
            raise ValueError(f"synthetic data mode {mode}: expected 1 (zeros) or 2 "
                             f"(random normal)")
        self.device = device
        self.mode = mode
        self._cache: dict[Any, list] = {}

    def _make(self, leaves: list) -> list:
        generator = torch.Generator().manual_seed(_SEED)
        made: list = []
        for leaf in leaves:
            if not isinstance(leaf, torch.Tensor):
                made.append(None)
            elif self.mode == ZEROS:
                made.append(torch.zeros(leaf.shape, dtype=leaf.dtype, device=self.device))
            else:
                values = torch.randn(leaf.shape, generator=generator, dtype=torch.float32)
                made.append(values.to(dtype=leaf.dtype, device=self.device))
        return made

    def __call__(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        leaves, spec = pytree.tree_flatten((args, kwargs))
        key = (spec, tuple((t.shape, t.dtype) if isinstance(t, torch.Tensor) else None
                           for t in leaves))
        cached = self._cache.get(key)
        if cached is None:
            cached = self._cache[key] = self._make(leaves)
        return pytree.tree_unflatten(
            [leaf if made is None else made for leaf, made in zip(leaves, cached,
                                                                   strict=True)], spec)
