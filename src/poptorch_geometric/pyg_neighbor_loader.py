"""Neighbour-sampled batches of fixed size on ``torch.utils.data.DataLoader``
(``FixedSizeNeighborLoader``): PyG's ``NeighborLoader`` samples, ``FixedSizeCollater``
pads."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.utils.data
import torch_geometric.typing
from torch_geometric.data import HeteroData
from torch_geometric.data.data import BaseData
from torch_geometric.loader import NeighborLoader
from torch_geometric.sampler import NeighborSampler
from torch_geometric.sampler.base import SubgraphType

from poptorch._logging import info_once

from .collate import FixedSizeCollater
from .fixed_size_options import FixedSizeOptions
from .pyg_dataloader import OverSizeStrategy, check_over_size_strategy, trims_edges, trims_nodes
from .samplers.neighbor import TorchNeighborSampler

__all__ = ["FixedSizeNeighborLoader", "default_neighbor_sampler"]

# What NeighborLoader adds to a sampled graph that describes the sampling, not the graph:
# kept aside while padding, put back on the padded batch.
_SAMPLING_KEYS = ("batch_size", "input_id", "seed_time", "num_sampled_nodes",
                  "num_sampled_edges")


def default_neighbor_sampler(data: Any, num_neighbors: Any, **sampler_args: Any
                             ) -> NeighborSampler | None:
    """PyG's sampler when pyg-lib or torch-sparse is installed (None: NeighborLoader
    builds it), else :py:class:`TorchNeighborSampler` with the same arguments."""
    if torch_geometric.typing.WITH_PYG_LIB or torch_geometric.typing.WITH_TORCH_SPARSE:
        return None
    return TorchNeighborSampler(data, num_neighbors, **sampler_args)


class FixedSizeNeighborLoader(torch.utils.data.DataLoader):
    """Samples a subgraph around each batch of ``batch_size`` input nodes (PyG's
    ``NeighborLoader``, with the same sampling arguments) and pads it to fixed numbers
    of nodes and edges (per type for ``HeteroData``).

    Without pyg-lib and torch-sparse the neighbours are sampled in torch
    (:py:class:`poptorch_geometric.samplers.neighbor.TorchNeighborSampler`).

    Args:
        data, num_neighbors, input_nodes, input_time, replace, directed, disjoint,
            temporal_strategy, time_attr, transform, transform_sampler_output,
            is_sorted, subgraph_type, neighbor_sampler: as PyG's ``NeighborLoader``.
        filter_per_worker: Accepted for PyG's signature; the sampled graph is always
            built where it is sampled (``True``), as padding needs it.
        batch_size: Input nodes per batch.
        over_size_strategy: What happens to a sampled graph larger than the fixed
            sizes (default: trim random nodes and edges).
        fixed_size_options: The fixed sizes. Default: measured on up to 1000 sampled
            batches (:py:meth:`FixedSizeOptions.from_loader`).
        add_pad_masks: Add ``graphs_mask``, ``nodes_mask`` and ``edges_mask``.
        follow_batch, exclude_keys: As for :py:class:`FixedSizeCollater`.
        kwargs: Other arguments of the base data loader (``shuffle``, ``drop_last``,
            ...).
    """

    def __init__(self, data: Any, num_neighbors: Any, input_nodes: Any = None,
                 input_time: torch.Tensor | None = None, replace: bool = False,
                 directed: bool = True, disjoint: bool = False,
                 temporal_strategy: str = "uniform", time_attr: str | None = None,
                 transform: Callable[..., Any] | None = None,
                 transform_sampler_output: Callable[..., Any] | None = None,
                 is_sorted: bool = False, filter_per_worker: bool = True,
                 subgraph_type: SubgraphType | str = SubgraphType.directional,
                 batch_size: int = 1, neighbor_sampler: NeighborSampler | None = None,
                 over_size_strategy: OverSizeStrategy = OverSizeStrategy.TrimNodesAndEdges,
                 fixed_size_options: FixedSizeOptions | None = None,
                 add_pad_masks: bool | None = False,
                 follow_batch: Sequence[str] | None = None,
                 exclude_keys: Sequence[str] | None = None, **kwargs: Any) -> None:
        over_size_strategy = check_over_size_strategy(over_size_strategy)
        self.filter_per_worker = filter_per_worker
        if not filter_per_worker:
            info_once("FixedSizeNeighborLoader.filter_per_worker",
                      "FixedSizeNeighborLoader: filter_per_worker=False is recorded but "
                      "the sampled graph is built where it is sampled, as padding needs "
                      "it.")
        if over_size_strategy == OverSizeStrategy.Skip:
            raise ValueError("OverSizeStrategy.Skip does not apply to neighbour sampling "
                             "(a batch is one sampled graph): use Error or a trimming "
                             "strategy.")
        if neighbor_sampler is None:
            neighbor_sampler = default_neighbor_sampler(
                data, num_neighbors, subgraph_type=subgraph_type, replace=replace,
                disjoint=disjoint, temporal_strategy=temporal_strategy,
                time_attr=time_attr, is_sorted=is_sorted, directed=directed,
                share_memory=kwargs.get("num_workers", 0) > 0)
        self.neighbour_loader = NeighborLoader(
            data, num_neighbors, input_nodes=input_nodes, input_time=input_time,
            replace=replace, subgraph_type=subgraph_type, disjoint=disjoint,
            temporal_strategy=temporal_strategy, time_attr=time_attr, transform=transform,
            transform_sampler_output=transform_sampler_output, is_sorted=is_sorted,
            filter_per_worker=True, neighbor_sampler=neighbor_sampler, directed=directed,
            batch_size=batch_size)
        self.input_type = self.neighbour_loader.input_data.input_type
        self.batch_size_per_sample = batch_size
        if fixed_size_options is None:
            fixed_size_options = FixedSizeOptions.from_loader(self.neighbour_loader)
        self.fixed_size_options = fixed_size_options
        self.fixed_size_collater = FixedSizeCollater(
            fixed_size_options, add_masks_to_batch=add_pad_masks,
            trim_nodes=trims_nodes(over_size_strategy),
            trim_edges=trims_edges(over_size_strategy), follow_batch=follow_batch,
            exclude_keys=exclude_keys)
        super().__init__(dataset=_indices(len(self.neighbour_loader.dataset)),
                         batch_size=batch_size, collate_fn=self._create_collater(),
                         **kwargs)

    def nativeCollate(self, index: list[int] | torch.Tensor) -> BaseData:
        """The graph PyG's ``NeighborLoader`` samples around input nodes ``index``."""
        return self.neighbour_loader(index)

    def fixedSizeCollate(self, sampled: BaseData) -> BaseData:
        """``sampled`` padded to the fixed sizes, of its own class (the sampling's own
        values, such as ``batch_size`` and ``input_id``, put back unchanged; the
        padding graphs' nodes are told apart by ``batch``, or by the masks)."""
        store = sampled[self.input_type] if isinstance(sampled, HeteroData) else sampled
        kept = {key: store[key] for key in _SAMPLING_KEYS if key in store}
        for key in kept:
            del store[key]
        try:
            out = self.fixed_size_collater([sampled])
        finally:
            for key, value in kept.items():
                store[key] = value
        # a sampled graph, as NeighborLoader gives it (a Batch would read ``batch_size``
        # as its number of graphs)
        padded = type(sampled).from_dict(out.to_dict())
        target = padded[self.input_type] if isinstance(padded, HeteroData) else padded
        for key, value in kept.items():
            target[key] = value
        return padded

    def _collate(self, index: list[int]) -> BaseData:
        return self.fixedSizeCollate(self.nativeCollate(index))

    def _create_collater(self) -> Any:
        return self._collate


def _indices(count: int) -> Any:
    """The data set of a loader that draws indices (``0 .. count - 1``)."""
    return range(count)
