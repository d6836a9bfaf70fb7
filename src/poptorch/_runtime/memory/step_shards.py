"""Weights sharded over the processes between steps and whole during a step: replicated
tensor sharding of weights / accumulators for the execution strategies (pipelined,
sharded, phased) in a run of several processes.

FSDP2 (``fsdp.py``) gathers a unit's weights around its forward and backward through
the module's own hooks. A strategy's stages are captured graphs that hold the model's
parameter objects and never call those hooks, so here the sharding is the step's:

* the update runs on this process's range of each bucket of sharded weights
  (``sharding.ManagedStep``: ZeRO-1's machinery, the optimizer state sharded with
  them); the other ranges are then dropped instead of gathered, and so are the
  weights' gradients: between steps a process holds ``1/n`` of each sharded weight (in
  host memory when the weights or accumulators are off chip on a GPU);
* the ranges are all-gathered back in place before the next step, and before anything
  else reads the model: a program's call (:func:`gather_released`), the module's
  ``state_dict()``, ``parameters()`` or an attribute (the weight sync's access hook).
  That is a collective, so every process must read, as for FSDP's full state dict.

During a step the accumulated gradients are whole (on the stages' devices, as without
sharding) and reduced over the processes at its end. ``load_state_dict`` into the
module gathers first, then writes whole tensors.
"""
from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
import torch.distributed as dist

from ..distributed.collectives import failures_as_errors
from ..distributed.world import World
from ..weights.sync import install_access_hook
from .layout import Piece, ShardLayout
from .offload import StateStorage
from .sharding import ManagedStep

#: The steps whose weights are dropped now, in the order they were dropped (every
#: process drops and gathers in the same order); a call gathers them first when it is
#: not empty.
released: list[weakref.ref[StepShardedStep]] = []


def gather_released() -> None:
    """Gather every dropped weight back (before a program's call); cheap when none."""
    while released:
        step = released.pop(0)()
        if step is not None:
            step.gather()


def _keep(values: torch.Tensor, off_chip: bool) -> torch.Tensor:
    """A copy of ``values`` kept between steps: in (pinned) host memory when off chip
    on a GPU, else where they are."""
    if off_chip and values.device.type != "cpu":
        host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
        return host.copy_(values)
    return values.clone()


class StepShardedStep(ManagedStep):
    """``ManagedStep`` that keeps only this process's share of the weights between
    steps (module docstring); ``host``: the user's module, read through the access
    hook."""

    def __init__(self, optimizer_of: Callable[[], torch.optim.Optimizer | None],
                 params: list[torch.nn.Parameter], layout: ShardLayout, world: World,
                 storage: StateStorage, host: torch.nn.Module, *, off_chip: bool,
                 flatten: bool) -> None:
        super().__init__(optimizer_of, params, layout, world, storage, flatten=flatten)
        self.off_chip = off_chip
        self.kept: list[torch.Tensor | None] = [None] * len(self.flats)
        # parameters with pieces outside the buckets: this process's pieces' values
        self.loose = sorted({q.param for q in layout.pieces if not self.flats or q.bucket < 0})
        self.loose_kept: dict[int, tuple[int, list[tuple[Piece, torch.Tensor]]]] = {}
        self.sharded_params = sorted(layout.by_param)
        self.released = False
        install_access_hook(host, self)

    # --- after the update: drop what other processes hold -------------------------
    def _after_update(self, b: int) -> None:
        """Keep this process's range of bucket ``b``; free the bucket."""
        flat = self.flats[b]
        start, end = self.layout.process_range(self.layout.buckets[b], self.world.rank)
        self.kept[b] = _keep(flat[start:end], self.off_chip)
        flat.untyped_storage().resize_(0)

    def _all_gather_weights(self) -> None:
        """Instead of gathering the updated pieces: keep this process's pieces of the
        parameters outside the buckets, free their storage, and drop the gradients."""
        rank = self.world.rank
        for i in self.loose:
            p = self.params[i]
            mine = [(q, _keep(p.data.view(-1)[q.start:q.end], self.off_chip))
                    for q in self.layout.by_param[i] if self.layout.process_of(q) == rank]
            storage = p.data.untyped_storage()
            self.loose_kept[i] = (storage.nbytes(), mine)
            storage.resize_(0)
        for i in self.sharded_params:
            self.params[i].grad = None
        for shard in self.pieces.values():
            shard.grad = None
            shard.data = torch.empty(0, dtype=shard.dtype, device=shard.device)
        self.released = True
        released.append(weakref.ref(self))

    # --- before a step or a read: gather ------------------------------------------
    def gather(self) -> None:
        """All-gather the dropped weights back in place (a collective)."""
        if not self.released:
            return
        self.released = False
        works = []
        with failures_as_errors("Gathering the sharded weights"):
            for b, flat in enumerate(self.flats):
                kept = self.kept[b]
                assert kept is not None  # (kept by _after_update)
                flat.untyped_storage().resize_(flat.numel() * flat.element_size())
                works.append(dist.all_gather_into_tensor(
                    flat, kept.to(flat.device), group=self.world.group, async_op=True))
            for i, (nbytes, mine) in self.loose_kept.items():
                p = self.params[i]
                p.data.untyped_storage().resize_(nbytes)
                for q, values in mine:
                    p.data.view(-1)[q.start:q.end].copy_(values)
            if self.loose_kept:
                super()._all_gather_weights()
            for work in works:
                work.wait()
        self.kept = [None] * len(self.flats)
        self.loose_kept = {}

    def to_host_if_needed(self) -> bool:
        """The weight sync's access hook: the user's module is read (gathers first)."""
        if not self.released:
            return False
        gather_released()
        return True

    def held_weight_bytes(self) -> int:
        """Bytes of the sharded weights this process holds now (whole during a step,
        its share between steps)."""
        if not self.released:
            return sum(self.params[i].numel() * self.params[i].element_size()
                       for i in self.sharded_params)
        kept = sum(t.numel() * t.element_size() for t in self.kept if t is not None)
        return kept + sum(v.numel() * v.element_size() for _, mine in
                          self.loose_kept.values() for _, v in mine)
