"""Synthetic data (``Options.enableSyntheticData``): no host-to-device input IO.

The device program runs on data of each input's shape and dtype created on the device
once per input signature and reused call after call, as PopART's synthetic data modes
do; the host tensors passed to the model are never read or transferred. This measures
compute without IO. Non-tensor arguments are passed through unchanged.

The modes are PopART's ``SyntheticDataMode``: 1, zeros; 2, random normal (mean 0,
variance 1), what ``enableSyntheticData(True)`` selects. As in PopART, floating inputs
(and complex ones) get the mode's values, the random ones drawn in float32 from a fixed
seed (the same data every run) and converted to the input's dtype. Integer and boolean
inputs get zeros in every mode: they are class labels, indices and masks, and a value
that indexes safely lets every program that ran on an IPU run here (an IPU does not
bounds-check a label of -1; ``nll_loss`` and ``embedding`` here do).
"""
from __future__ import annotations

from typing import Any

import torch

from ..torch_internals import pytree

ZEROS = 1
RANDOM_NORMAL = 2
MODES = {ZEROS: "zeros", RANDOM_NORMAL: "random normal"}
_SEED = 0  # random normal data: fixed, as PopART's default-seeded generator


def _takes_random_values(dtype: torch.dtype) -> bool:
    """Whether random normal synthetic data fills inputs of ``dtype`` (floating and
    complex ones); integer and boolean inputs are indices, labels or masks: zeros."""
    return dtype.is_floating_point or dtype.is_complex


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
            elif self.mode == ZEROS or not _takes_random_values(leaf.dtype):
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
