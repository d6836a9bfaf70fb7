"""The optimizer step on the weight shards of ``fsdp.ShardedModel``.

The user's optimizer runs the update on plain tensors, as for the sharded optimizer
state (``sharding.ManagedStep``, whose machinery this reuses): for the step its
``param_groups`` hold piece parameters aliasing each process's rows of the DTensor
parameters (``to_local()``: the update writes the shards in place) and their
reduce-scattered gradients, plus the parameters kept whole. Loss scaling, clipping
over all shards of all processes, off-chip optimizer state and the gathered
``optimizer.state_dict()`` (which resumes at any world size, with or without sharding)
are ``ManagedStep``'s. Nothing is gathered after the update: FSDP2 gathers each unit's
weights before its next forward.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch.distributed.tensor import DTensor

from ..numerics.loss_scaling import PENDING_UNSCALE_ATTR
from .layout import Piece, ShardLayout
from .sharding import ManagedStep

if TYPE_CHECKING:
    from ..distributed.world import World
    from .offload import StateStorage


def shard_layout(params: list[torch.nn.Parameter], processes: int) -> ShardLayout:
    """FSDP2's ``Shard(0)`` shards as pieces: process ``k`` owns rows
    ``k*ceil(d/n) .. (k+1)*ceil(d/n)`` of a parameter of ``d`` rows (as
    ``torch.chunk``); parameters that are not DTensors stay whole on every process."""
    pieces: list[Piece] = []
    replicated: list[int] = []
    for i, p in enumerate(params):
        if not isinstance(p, DTensor) or not p.requires_grad:
            replicated.append(i)
            continue
        rows = p.shape[0]
        row = p.numel() // rows if rows else 0
        per = -(-rows // processes)
        for k in range(processes):
            start, end = min(rows, k * per), min(rows, (k + 1) * per)
            if end > start:
                pieces.append(Piece(i, start * row, end * row, k))
    pieces.sort(key=lambda q: (q.owner, q.param, q.start))
    return ShardLayout(pieces, replicated, 1, processes)


class ShardedStep(ManagedStep):
    """``ManagedStep`` over the local shards of DTensor parameters (module docstring)."""

    def __init__(self, optimizer_of: Callable[[], torch.optim.Optimizer | None],
                 params: list[torch.nn.Parameter], world: World,
                 storage: StateStorage) -> None:
        super().__init__(optimizer_of, params, shard_layout(params, world.size), world,
                         storage, flatten=False)
        self.gather_plan = []

    def _point_pieces(self) -> None:
        """Each piece parameter aliases this process's shard and its gradient."""
        for piece, shard in self.pieces.items():
            p = self.params[piece.param]
            assert isinstance(p, DTensor)  # (the layout's pieces are DTensors' rows)
            shard.data = p.to_local().view(-1)
            grad = p.grad
            if grad is None:
                shard.grad = None
                continue
            view = (grad.to_local() if isinstance(grad, DTensor) else grad).reshape(-1)
            divisor = getattr(grad, PENDING_UNSCALE_ATTR, None)
            if divisor is not None:
                setattr(view, PENDING_UNSCALE_ATTR, divisor)
            shard.grad = view

    def _all_gather_weights(self) -> None:
        """Nothing: FSDP2 gathers a unit's weights before its next forward."""
        return None
