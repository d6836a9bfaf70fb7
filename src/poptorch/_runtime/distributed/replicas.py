"""What a compiled model does across processes: start identical, stay identical.

At compile time process 0's weights, buffers and optimizer state are sent to every
process (a run may start from different random initialisations). During training the
gradients of each step are summed over all processes before the update
(:py:class:`~.reducer.GradientReducer`), so the updates agree. With ``broadcastBuffers``
(the default) process 0's buffers (those of global replica 0) are sent to every process
after each optimizer step (inference: each call), as replica 0's are to the local
replicas; without it each process's buffers drift apart, as PopTorch's replicas do.
"""
from __future__ import annotations

from typing import Any, List, Optional

import torch
import torch.distributed as dist

from .collectives import broadcast_, failures_as_errors
from .reducer import GradientReducer
from .world import World


class CrossProcessReplicas:
    """The cross-process side of a compiled model (see module docstring)."""

    def __init__(self, world: World, model: torch.nn.Module,
                 params: List[torch.nn.Parameter], broadcast_buffers: bool) -> None:
        self.world = world
        self.model = model
        self.reducer = GradientReducer(world, params)
        self.buffers = [b for b in model.buffers()] if broadcast_buffers else []

    def start_identical(self, optimizer: Optional[Any]) -> None:
        """Give every process process 0's weights, buffers and optimizer state."""
        tensors = list(self.model.parameters()) + list(self.model.buffers())
        broadcast_([t.data for t in tensors], self.world.group)
        if optimizer is None:
            return
        # Process 0 decides for all (a collective must be called by every process).
        has_state = self.world.rank == 0 and any(optimizer.state.values())
        state = [optimizer.state_dict() if has_state else None]
        with failures_as_errors("Broadcasting the optimizer state"):
            dist.broadcast_object_list(state, src=0, group=self.world.group)
        if state[0] is not None and self.world.rank != 0:
            optimizer.load_state_dict(state[0])

    def reduce_gradients(self) -> None:
        """Sum this step's gradients over all processes."""
        self.reducer()

    def sync_buffers(self) -> None:
        """Send process 0's buffers to every process (no-op without broadcastBuffers)."""
        if self.buffers:
            broadcast_([b.data for b in self.buffers], self.world.group)
