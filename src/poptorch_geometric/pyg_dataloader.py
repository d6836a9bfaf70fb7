"""Data loaders on ``torch.utils.data.DataLoader``: PyG's ``DataLoader`` with a
replaceable collater, and the ``FixedSizeDataLoader`` that pads every batch to fixed
numbers of nodes, edges and graphs (the ``poptorch.DataLoader`` versions are in
``dataloader``)."""
from __future__ import annotations

from collections.abc import Sequence
from enum import Enum
from typing import Any

import torch.utils.data
from torch.utils.data.sampler import RandomSampler, SequentialSampler
from torch_geometric.data import HeteroData

from .collate import FixedSizeCollater
from .fixed_size_options import FixedSizeOptions
from .pyg_collate import Collater
from .stream_packing_sampler import StreamPackingSampler

__all__ = ["DataLoader", "FixedSizeDataLoader", "FixedSizeStrategy", "OverSizeStrategy"]


class FixedSizeStrategy(Enum):
    """How a fixed-size loader fills its batches.

    - ``PadToMax``: ``batch_size - 1`` real graphs per batch, then padding up to the
      fixed sizes.
    - ``StreamPack``: as many real graphs as fit (:py:class:`StreamPackingSampler`):
      the number of real graphs varies, less of each batch is padding.
    """
    PadToMax = 0
    StreamPack = 1


class OverSizeStrategy(Enum):
    """What a fixed-size loader does with graphs that do not fit in a batch.

    - ``Error``: raise an error.
    - ``Skip``: leave out the graphs that do not fit.
    - ``TrimNodes``: remove random nodes (and their edges) until the batch fits; the
      graphs lose information.
    - ``TrimEdges``: remove random edges until the batch fits.
    - ``TrimNodesAndEdges``: remove random nodes, then random edges.
    """
    Error = 0
    Skip = 1
    TrimNodes = 2
    TrimEdges = 3
    TrimNodesAndEdges = 4


def trims_nodes(strategy: OverSizeStrategy) -> bool:
    return strategy in (OverSizeStrategy.TrimNodes, OverSizeStrategy.TrimNodesAndEdges)


def trims_edges(strategy: OverSizeStrategy) -> bool:
    return strategy in (OverSizeStrategy.TrimEdges, OverSizeStrategy.TrimNodesAndEdges)


def check_over_size_strategy(strategy: Any) -> OverSizeStrategy:
    if not isinstance(strategy, OverSizeStrategy):
        raise TypeError("over_size_strategy must be a poptorch_geometric.OverSizeStrategy, "
                        f"got {strategy!r}.")
    return strategy


class DataLoader(torch.utils.data.DataLoader):
    """PyG's ``DataLoader``: merges the ``Data`` / ``HeteroData`` items of a data set
    into ``Batch`` objects (subclasses replace the collater with ``_create_collater``).

    Args:
        dataset: The data set.
        batch_size: Graphs per batch.
        shuffle: Reshuffle the data at every epoch.
        follow_batch: Keys for which to add a batch assignment vector.
        exclude_keys: Keys to leave out of the batches.
        kwargs: Other arguments of the base data loader (``collate_fn`` is replaced).
    """

    def __init__(self, dataset: Any, batch_size: int = 1, shuffle: bool = False,
                 follow_batch: Sequence[str] | None = None,
                 exclude_keys: Sequence[str] | None = None, **kwargs: Any) -> None:
        kwargs.pop("collate_fn", None)
        self.follow_batch = follow_batch
        self.exclude_keys = exclude_keys
        collater = self._create_collater(follow_batch=follow_batch,
                                         exclude_keys=exclude_keys)
        super().__init__(dataset=dataset, batch_size=batch_size, shuffle=shuffle,
                         collate_fn=collater, **kwargs)

    def _create_collater(self, **collater_args: Any) -> Any:
        return Collater(**collater_args)


class FixedSizeDataLoader(torch.utils.data.DataLoader):
    """Merges the graphs of a data set into batches padded to fixed numbers of nodes,
    edges and graphs (``Data`` or ``HeteroData``), so that every batch has tensors of
    the same shapes.

    Args:
        dataset: The data set.
        batch_size: Graphs per batch, padding graphs included (at least 2); equal to
            ``fixed_size_options.num_graphs``.
        shuffle: Reshuffle the data at every epoch.
        fixed_size_options: The fixed sizes. Default: enough for any ``batch_size - 1``
            graphs of the data set (:py:meth:`FixedSizeOptions.from_dataset`).
        fixed_size_strategy: How batches are filled (:py:class:`FixedSizeStrategy`).
        over_size_strategy: What happens to graphs that do not fit
            (:py:class:`OverSizeStrategy`).
        add_pad_masks: Add ``graphs_mask``, ``nodes_mask`` and ``edges_mask``.
        follow_batch: Keys for which to add a batch assignment vector.
        exclude_keys: Keys to leave out of the batches.
        kwargs: Other arguments of the base data loader (a ``batch_sampler`` yields
            the graphs of each batch, at most ``batch_size - 1``; no ``collate_fn``).
    """

    def __init__(self, dataset: Any, batch_size: int = 2, shuffle: bool = False,
                 fixed_size_options: FixedSizeOptions | None = None,
                 fixed_size_strategy: FixedSizeStrategy = FixedSizeStrategy.PadToMax,
                 over_size_strategy: OverSizeStrategy = OverSizeStrategy.Error,
                 add_pad_masks: bool | None = True,
                 follow_batch: Sequence[str] | None = None,
                 exclude_keys: Sequence[str] | None = None, **kwargs: Any) -> None:
        if "collate_fn" in kwargs:
            raise TypeError(
                f"Cannot set `collate_fn` with `{self.__class__.__name__}`. Consider "
                "attaching a torch_geometric.transforms.Pad transform after your "
                "collate_fn and use it with `torch.utils.data.DataLoader` to achieve "
                "fixed size batches.")
        over_size_strategy = check_over_size_strategy(over_size_strategy)
        if fixed_size_options is None:
            fixed_size_options = FixedSizeOptions.from_dataset(dataset, batch_size)
        first = dataset[0]
        if isinstance(first, HeteroData) and not fixed_size_options.is_hetero():
            fixed_size_options.to_hetero(first.node_types, first.edge_types)
        if batch_size != fixed_size_options.num_graphs:
            raise ValueError(
                "`num_graphs` in fixed size options must match provided batch size in "
                f"dataloader. `num_graphs` is {fixed_size_options.num_graphs} but batch size "
                f"is {batch_size}.")
        self.fixed_size_options = fixed_size_options
        self.padded_batch_size = batch_size
        batch_sampler = kwargs.pop("batch_sampler", None)
        if fixed_size_strategy == FixedSizeStrategy.StreamPack:
            if batch_sampler is not None:
                raise ValueError(
                    f"Fixed size strategy {fixed_size_strategy} is incompatible with the "
                    f"provided batch_sampler {batch_sampler}. Either use a different "
                    "strategy or set `batch_sampler` to `None`.")
            batch_sampler = StreamPackingSampler(
                dataset, batch_size - 1,
                max_num_nodes=fixed_size_options.total_num_nodes - 1,
                max_num_edges=fixed_size_options.total_num_edges - 1,
                base_sampler=RandomSampler(dataset) if shuffle else SequentialSampler(dataset),
                allow_skip_data=over_size_strategy == OverSizeStrategy.Skip)
        elif fixed_size_strategy != FixedSizeStrategy.PadToMax:
            raise ValueError(f"fixed_size_strategy must be a "
                             f"poptorch_geometric.FixedSizeStrategy, got "
                             f"{fixed_size_strategy!r}.")
        self.batch_sampler_given = batch_sampler is not None
        skip = (over_size_strategy == OverSizeStrategy.Skip
                and fixed_size_strategy == FixedSizeStrategy.PadToMax)
        collater = self._create_collater(
            fixed_size_options=fixed_size_options, add_masks_to_batch=add_pad_masks,
            trim_nodes=trims_nodes(over_size_strategy),
            trim_edges=trims_edges(over_size_strategy), follow_batch=follow_batch,
            exclude_keys=exclude_keys, skip_over_size=skip)
        if batch_sampler is not None:
            # the batch sampler decides: torch's defaults for batch_size and shuffle
            super().__init__(dataset=dataset, batch_size=1, shuffle=None,
                             batch_sampler=batch_sampler, collate_fn=collater, **kwargs)
        else:
            super().__init__(dataset=dataset, batch_size=batch_size - 1, shuffle=shuffle,
                             collate_fn=collater, **kwargs)

    def _create_collater(self, **collater_args: Any) -> Any:
        return FixedSizeCollater(**collater_args)
