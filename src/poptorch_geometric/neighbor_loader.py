"""``FixedSizeNeighborLoader`` on ``poptorch.DataLoader``: the fixed-size sampled graphs
of one model call joined along dimension 0."""
from __future__ import annotations

from typing import Any

import poptorch

from .collate import CombinedBatchingCollater
from .pyg_neighbor_loader import FixedSizeNeighborLoader as PyGFixedSizeNeighborLoader

__all__ = ["FixedSizeNeighborLoader", "PyGFixedSizeNeighborLoader"]


class FixedSizeNeighborLoader(PyGFixedSizeNeighborLoader, poptorch.DataLoader):
    """:py:class:`poptorch_geometric.pyg_neighbor_loader.FixedSizeNeighborLoader` on
    :py:class:`poptorch.DataLoader`: each batch holds one padded sampled graph (around
    ``batch_size`` input nodes) per micro-batch of the model call.

    Takes the arguments of the ``pyg_neighbor_loader`` version (``add_pad_masks``
    defaults to True here), plus ``options`` (the :py:class:`poptorch.Options` of the
    model; default options when None) and the other arguments of
    :py:class:`poptorch.DataLoader`.
    """

    def __init__(self, data: Any, num_neighbors: Any, *args: Any,
                 options: poptorch.Options | None = None, **kwargs: Any) -> None:
        kwargs.setdefault("add_pad_masks", True)
        super().__init__(data, num_neighbors, *args,
                         options=poptorch.Options() if options is None else options,
                         **kwargs)

    def _create_collater(self) -> Any:
        return CombinedBatchingCollater(super()._create_collater(),
                                        mini_batch_size=self.batch_size_per_sample)
