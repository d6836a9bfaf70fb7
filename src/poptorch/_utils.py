"""Helpers that upstream PopTorch keeps in ``poptorch._utils`` and libraries import."""
from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from .errors import Error

__all__ = ["combine_batch_tensors_gen"]


def combine_batch_tensors_gen(tensors: Sequence[Sequence[torch.Tensor]]
                              ) -> Iterator[torch.Tensor]:
    """Joins batches given as lists of their tensors (one list per batch, the tensors in
    the same order in each) tensor by tensor: yields the concatenation along dimension 0
    of the first tensors of every batch, then of the second tensors, and so on.

    This is how micro-batches become the combined batch of one call of a model.
    """
    if not tensors:
        return
    count = len(tensors[0])
    if any(len(batch) != count for batch in tensors):
        raise Error("combine_batch_tensors_gen: the batches hold different numbers of "
                    f"tensors ({[len(batch) for batch in tensors]}); they must have the "
                    "same structure.")
    for position in range(count):
        yield torch.cat([batch[position] for batch in tensors])
