"""Cluster-GCN batches of fixed size on ``torch.utils.data.DataLoader``
(``FixedSizeClusterLoader``), and ``ClusterData`` that partitions without METIS when
PyG's compiled extensions are missing."""
from __future__ import annotations

from typing import Any

import torch
import torch.utils.data
import torch_geometric.typing
from torch_geometric.data import Batch, Data
from torch_geometric.loader import ClusterData as _PyGClusterData
from torch_geometric.loader import ClusterLoader

from poptorch._logging import info_once

from .collate import FixedSizeCollater
from .fixed_size_options import FixedSizeOptions
from .pyg_dataloader import OverSizeStrategy, check_over_size_strategy, trims_edges, trims_nodes
from .samplers.partition import partition_nodes

__all__ = ["ClusterData", "FixedSizeClusterLoader"]


class ClusterData(_PyGClusterData):
    """PyG's ``ClusterData`` (same arguments): partitions a graph into ``num_parts``
    clusters, with METIS when pyg-lib or torch-sparse provides it, else with
    :func:`poptorch_geometric.samplers.partition.partition_nodes` (equal parts of a
    breadth-first order; ``recursive`` has no meaning there and is not used).
    """

    def _metis(self, edge_index: torch.Tensor, num_nodes: int) -> torch.Tensor:
        if torch_geometric.typing.WITH_TORCH_SPARSE or torch_geometric.typing.WITH_METIS:
            return super()._metis(edge_index, num_nodes)
        info_once("poptorch_geometric.ClusterData",
                  "poptorch_geometric.ClusterData: METIS (pyg-lib or torch-sparse) is not "
                  "installed; clusters are equal runs of a breadth-first node order.")
        return partition_nodes(edge_index, num_nodes, self.num_parts)


class FixedSizeClusterLoader(torch.utils.data.DataLoader):
    """Merges ``batch_size`` clusters of a ``ClusterData`` into one graph per batch
    (PyG's ``ClusterLoader``, keeping the edges between the batch's clusters) and pads
    it to fixed numbers of nodes and edges.

    Args:
        cluster_data: The partitioned graph (PyG's ``ClusterData`` or
            :py:class:`ClusterData`).
        fixed_size_options: The fixed sizes (``num_graphs``: the merged graph plus
            padding graphs, at least 2).
        batch_size: Clusters per batch.
        over_size_strategy: What happens to a batch larger than the fixed sizes
            (default: trim random nodes and edges).
        add_pad_masks: Add ``graphs_mask``, ``nodes_mask`` and ``edges_mask``.
        kwargs: Other arguments of the base data loader (``shuffle``, ``exclude_keys``,
            ...; no ``collate_fn`` or ``batch_sampler``).
    """

    def __init__(self, cluster_data: _PyGClusterData, fixed_size_options: FixedSizeOptions,
                 batch_size: int = 1,
                 over_size_strategy: OverSizeStrategy = OverSizeStrategy.TrimNodesAndEdges,
                 add_pad_masks: bool | None = True, **kwargs: Any) -> None:
        unsupported = sorted(set(kwargs) & {"collate_fn", "batch_sampler"})
        if unsupported:
            raise TypeError(f"`{type(self).__name__}` does not support the arguments "
                            f"{unsupported}: it collates the clusters of each batch itself.")
        over_size_strategy = check_over_size_strategy(over_size_strategy)
        if over_size_strategy == OverSizeStrategy.Skip:
            raise ValueError("OverSizeStrategy.Skip does not apply to clusters (a batch is "
                             "one merged graph): use Error or a trimming strategy.")
        self.cluster_data = cluster_data
        self.clusters_per_batch = batch_size
        self.cluster_collater = ClusterLoader(cluster_data, batch_size=batch_size).collate_fn
        self.fixed_size_collater = FixedSizeCollater(
            fixed_size_options, add_masks_to_batch=add_pad_masks,
            trim_nodes=trims_nodes(over_size_strategy),
            trim_edges=trims_edges(over_size_strategy),
            exclude_keys=kwargs.pop("exclude_keys", None),
            skip_over_size=False)
        super().__init__(dataset=_indices(len(cluster_data)), batch_size=batch_size,
                         collate_fn=self._create_collater(), **kwargs)

    def _collate(self, cluster_ids: list[int]) -> Batch:
        """The clusters ``cluster_ids`` merged into one graph, padded."""
        merged: Data = self.cluster_collater(cluster_ids)
        return self.fixed_size_collater([merged])

    def _create_collater(self) -> Any:
        return self._collate


def _indices(count: int) -> Any:
    """The data set of a loader that draws indices (``0 .. count - 1``)."""
    return range(count)
