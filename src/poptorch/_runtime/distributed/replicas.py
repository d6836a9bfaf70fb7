"""What a compiled model does across processes: start identical, stay identical.

At compile time process 0's weights, buffers and optimizer state go to every process
(the processes may start from different random initialisations); each step's gradients
are summed over all processes before the update (DDP, or the reducer); with
``broadcastBuffers`` (the default) process 0's buffers go to every process after each
optimizer step, as replica 0's do to the local replicas. Inference needs none of this.
"""
from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from ..program.interpreter import EagerCompute, Interpreter
from . import world as world_module
from .collectives import broadcast_, failures_as_errors
from .ddp import DdpSync
from .reducer import GradientReducer
from .world import World

if TYPE_CHECKING:
    from ..memory.fsdp import ShardedModel, WeightPlacement
    from ..program.backend_trial import CrossProcessAgreement

_live: weakref.WeakSet[DataParallelGroup] = weakref.WeakSet()


def _release_all() -> None:
    for replicas in list(_live):
        replicas.release()


world_module.on_leave(_release_all)


class DataParallelGroup:
    """The cross-process side of a compiled model (see module docstring)."""

    def __init__(self, world: World, model: torch.nn.Module,
                 params: list[torch.nn.Parameter], broadcast_buffers: bool) -> None:
        _live.add(self)
        self.world = world
        self.model = model
        self.params = params
        self.reducer: GradientReducer | None = GradientReducer(world, params)
        self.buffers = list(model.buffers()) if broadcast_buffers else []
        self.ddp_sync: DdpSync | None = None
        # Weights / accumulators sharded over the processes (FSDP2, memory.fsdp): their
        # gradients are reduce-scattered in the backward; the reducer sums the others.
        self.sharded: ShardedModel | None = None
        # The same for the stages of an execution strategy: sharded between steps
        # (memory.step_shards), gathered by ``before_step`` at a step's start.
        self.step_placement: WeightPlacement | None = None
        self.before_step: Callable[[], None] | None = None
        # How many processes the reduced gradients were divided by: DDP averages, the
        # reducer sums. The device program scales the result to PopTorch's Mean / Sum.
        self.averaged_over = 1
        # While the compiled backend may run a step (its backward pass bypasses DDP's
        # hooks), every step reduces with the reducer, the one collective both backends
        # share, carrying the agreement's values; it detaches itself once every process
        # has left the compiled backend.
        self.agreement: CrossProcessAgreement | None = None

    def attach_agreement(self, agreement: CrossProcessAgreement | None) -> None:
        """Reduce with the reducer and ``agreement``'s values (None: let DDP take the
        reduction over once the processes have run eager steps)."""
        self.agreement = agreement

    def attach_sync(self, interpreter: Interpreter | None, compute: EagerCompute | None,
                    grouped: bool, device: torch.device) -> None:
        """Give the one-stage interpreter over the model itself DDP's overlapped
        reduction: an ``ALL_REDUCE`` before the last micro-batch of each step
        (``ddp.DdpSync``). Other runners (model parallel; replica-grouped weights, whose
        shapes change per replica) keep the reduction after the backward passes."""
        if interpreter is None or compute is None or grouped or self.sharded is not None:
            return
        # DDP takes over after the first step (``ddp`` module docstring).
        self.ddp_sync = DdpSync(compute, self.params)
        interpreter.sync = self.ddp_sync
        self.device = device

    def release(self) -> None:
        """Free DDP while ``self.world`` still holds the process group: DDP's C++
        reducer must not drop the last reference to it, as that destroys the group with
        the GIL held and can deadlock with gloo's worker threads (pytorch#56297). Called
        when this object goes, and for every live one at exit."""
        sync = self.__dict__.get("ddp_sync")
        if sync is not None:
            sync.compute.forward_fn = self.model
            sync.ddp = None
            self.ddp_sync = None
            self.reducer = None

    def __del__(self) -> None:
        self.release()

    def begin_step(self) -> None:
        """Before the micro-batches of a training step (the schedule's ``ALL_REDUCE``
        action marks the micro-batch whose backward reduces; sharded weights count
        their micro-batches)."""
        if self.sharded is not None:
            self.sharded.begin_step()
        if self.before_step is not None:
            self.before_step()

    def start_identical(self, optimizer: torch.optim.Optimizer | None) -> None:
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

    def shard_weights(self, sharded: ShardedModel, optimizer: torch.optim.Optimizer | None
                      ) -> None:
        """Take over the weights / accumulators ``sharded`` over the processes
        (``memory.fsdp``; made after :py:meth:`start_identical`: each process keeps its
        rows of process 0's weights). No DDP: FSDP2 reduce-scatters the sharded
        gradients (averages over the processes); those of the parameters kept whole are
        summed here by the reducer and divided to match."""
        self.sharded = sharded
        sharded.rebind(optimizer)
        self.params = sharded.whole_params
        self.reducer = GradientReducer(self.world, self.params)
        self.averaged_over = self.world.size

    def reduce_gradients(self) -> None:
        """Sum this step's gradients over all processes (done already by DDP during
        the backward pass when the runner uses it)."""
        if self.reducer is None:
            return
        if self.sharded is not None:
            self.reducer()
            for p in self.params:
                if p.grad is not None:
                    p.grad.div_(self.world.size)
            return
        agreement = self.agreement
        totals = self.reducer(agreement.local_values() if agreement is not None else ())
        if agreement is not None:
            # (if the processes leave the compiled backend here, DDP attaches at a later
            # step, once every process has run an eager step)
            agreement.settle(totals)
            return
        sync = self.ddp_sync
        if sync is not None and sync.ddp is None and sync.last_used is not None:
            used = torch.tensor(sync.last_used, dtype=torch.float32)
            with failures_as_errors("Comparing the parameters used by each process"):
                dist.all_reduce(used, group=self.world.group)
            sync.attach(self.model, self.world.group, self.device,
                        bool((used == self.world.size).all()))
            self.reducer = None
            self.averaged_over = self.world.size

    def sync_buffers(self) -> None:
        """Send process 0's buffers to every process (no-op without broadcastBuffers)."""
        if self.buffers:
            broadcast_([b.data for b in self.buffers], self.world.group)
