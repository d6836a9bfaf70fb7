"""The loaders to feed a PopTorch model: the ``pyg_dataloader`` loaders on
``poptorch.DataLoader``, whose batches hold the micro-batches of one model call
(``deviceIterations x replicationFactor x gradientAccumulation`` of them) joined along
dimension 0."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import poptorch

from .collate import CombinedBatchingCollater
from .fixed_size_options import FixedSizeOptions
from .pyg_dataloader import DataLoader as PyGDataLoader
from .pyg_dataloader import FixedSizeDataLoader as PyGFixedSizeDataLoader
from .pyg_dataloader import FixedSizeStrategy, OverSizeStrategy

__all__ = ["DataLoader", "FixedSizeDataLoader", "FixedSizeStrategy", "OverSizeStrategy"]


class DataLoader(PyGDataLoader, poptorch.DataLoader):
    """PyG's ``DataLoader`` on :py:class:`poptorch.DataLoader`: each batch holds the
    micro-batches of ``batch_size`` graphs of one model call, joined.

    Args:
        dataset: The data set.
        batch_size: Graphs per micro-batch.
        shuffle: Reshuffle the data at every epoch.
        follow_batch: Keys for which to add a batch assignment vector.
        exclude_keys: Keys to leave out of the batches.
        options: The :py:class:`poptorch.Options` of the model (default options when
            None).
        kwargs: Other arguments of :py:class:`poptorch.DataLoader`.
    """

    def __init__(self, dataset: Any, batch_size: int = 1, shuffle: bool = False,
                 follow_batch: Sequence[str] | None = None,
                 exclude_keys: Sequence[str] | None = None,
                 options: poptorch.Options | None = None, **kwargs: Any) -> None:
        self.batch_size_per_micro_batch = batch_size
        super().__init__(dataset=dataset, batch_size=batch_size, shuffle=shuffle,
                         follow_batch=follow_batch, exclude_keys=exclude_keys,
                         options=poptorch.Options() if options is None else options,
                         **kwargs)

    def _create_collater(self, **collater_args: Any) -> Any:
        return CombinedBatchingCollater(super()._create_collater(**collater_args),
                                        mini_batch_size=self.batch_size_per_micro_batch)


class FixedSizeDataLoader(PyGFixedSizeDataLoader, poptorch.DataLoader):
    """:py:class:`poptorch_geometric.pyg_dataloader.FixedSizeDataLoader` on
    :py:class:`poptorch.DataLoader`: each batch holds the fixed-size micro-batches of
    one model call, joined along dimension 0.

    Takes the arguments of the ``pyg_dataloader`` version, plus ``options`` (the
    :py:class:`poptorch.Options` of the model; default options when None) and the
    other arguments of :py:class:`poptorch.DataLoader`.
    """

    def __init__(self, dataset: Any, batch_size: int = 2, shuffle: bool = False,
                 fixed_size_options: FixedSizeOptions | None = None,
                 fixed_size_strategy: FixedSizeStrategy = FixedSizeStrategy.PadToMax,
                 over_size_strategy: OverSizeStrategy = OverSizeStrategy.Error,
                 add_pad_masks: bool | None = True,
                 follow_batch: Sequence[str] | None = None,
                 exclude_keys: Sequence[str] | None = None,
                 options: poptorch.Options | None = None, **kwargs: Any) -> None:
        super().__init__(dataset=dataset, batch_size=batch_size, shuffle=shuffle,
                         fixed_size_options=fixed_size_options,
                         fixed_size_strategy=fixed_size_strategy,
                         over_size_strategy=over_size_strategy, add_pad_masks=add_pad_masks,
                         follow_batch=follow_batch, exclude_keys=exclude_keys,
                         options=poptorch.Options() if options is None else options,
                         **kwargs)

    def _create_collater(self, **collater_args: Any) -> Any:
        # with a batch sampler each micro-batch is collated alone and poptorch.DataLoader
        # joins them; otherwise the collater gets all the graphs of one call
        mini_batch_size = None if self.batch_sampler_given else self.padded_batch_size - 1
        return CombinedBatchingCollater(super()._create_collater(**collater_args),
                                        mini_batch_size=mini_batch_size)
