"""``FixedSizeClusterLoader`` on ``poptorch.DataLoader``: the fixed-size cluster batches
of one model call joined along dimension 0."""
from __future__ import annotations

from typing import Any

from torch_geometric.loader import ClusterData

import poptorch

from .collate import CombinedBatchingCollater
from .fixed_size_options import FixedSizeOptions
from .pyg_cluster_loader import FixedSizeClusterLoader as PyGFixedSizeClusterLoader
from .pyg_dataloader import OverSizeStrategy

__all__ = ["FixedSizeClusterLoader"]


class FixedSizeClusterLoader(PyGFixedSizeClusterLoader, poptorch.DataLoader):
    """:py:class:`poptorch_geometric.pyg_cluster_loader.FixedSizeClusterLoader` on
    :py:class:`poptorch.DataLoader`: each batch holds one padded cluster batch of
    ``batch_size`` clusters per micro-batch of the model call.

    Takes the arguments of the ``pyg_cluster_loader`` version, plus ``options`` (the
    :py:class:`poptorch.Options` of the model; default options when None) and the other
    arguments of :py:class:`poptorch.DataLoader`.
    """

    def __init__(self, cluster_data: ClusterData, fixed_size_options: FixedSizeOptions,
                 batch_size: int = 1,
                 over_size_strategy: OverSizeStrategy = OverSizeStrategy.TrimNodesAndEdges,
                 add_pad_masks: bool | None = True, options: poptorch.Options | None = None,
                 **kwargs: Any) -> None:
        super().__init__(cluster_data=cluster_data, fixed_size_options=fixed_size_options,
                         batch_size=batch_size, over_size_strategy=over_size_strategy,
                         add_pad_masks=add_pad_masks,
                         options=poptorch.Options() if options is None else options,
                         **kwargs)

    def _create_collater(self) -> Any:
        return CombinedBatchingCollater(super()._create_collater(),
                                        mini_batch_size=self.clusters_per_batch)
