"""What a compiled model does across processes: start identical, stay identical.

At compile time process 0's weights, buffers and optimizer state are sent to every
process (a run may start from different random initialisations). During training the
gradients of each step are summed over all processes before the update
(:py:class:`~.reducer.GradientReducer`), so the updates agree. With ``broadcastBuffers``
(the default) process 0's buffers (those of global replica 0) are sent to every process
after each optimizer step, as replica 0's are to the local replicas; without it each
process's buffers drift apart, as PopTorch's replicas do. Inference models need none of
this: they run on each process on their own.
"""
from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.distributed as dist

from ..program.replica_groups import GroupedParameter
from ..program.runner import PerReplicaRunner, SequentialRunner
from . import world as world_module
from .collectives import broadcast_, failures_as_errors
from .ddp import SyncOnLastMicrobatch, find_unused_forced, make_ddp
from .reducer import GradientReducer
from .world import World

_live: weakref.WeakSet[CrossProcessReplicas] = weakref.WeakSet()


def _release_all() -> None:
    for replicas in list(_live):
        replicas.release()


world_module.on_leave(_release_all)


class CrossProcessReplicas:
    """The cross-process side of a compiled model (see module docstring)."""

    def __init__(self, world: World, model: torch.nn.Module,
                 params: list[torch.nn.Parameter], broadcast_buffers: bool) -> None:
        _live.add(self)
        self.world = world
        self.model = model
        self.params = params
        self.reducer: Any = GradientReducer(world, params)
        self.buffers = list(model.buffers()) if broadcast_buffers else []
        self.ddp_runner: Any = None
        # How many processes the reduced gradients were divided by: DDP averages, the
        # reducer sums. The device program scales the result to PopTorch's Mean / Sum.
        self.averaged_over = 1
        # While the compiled backend may run a step (its backward pass does not go
        # through DDP's hooks), ``agreement`` (backend_trial.CrossProcessAgreement) is
        # attached: every step reduces with the reducer, the one collective both
        # backends share, with the agreement's values, and DDP is not attached. The
        # agreement detaches itself once every process has left the compiled backend.
        self.agreement: Any = None

    def attach_agreement(self, agreement: Any) -> None:
        """Reduce with the reducer and ``agreement``'s values (None: let DDP take the
        reduction over once the processes have run eager steps)."""
        self.agreement = agreement

    def wrap_runner(self, runner: Any, per_step: int, device: torch.device) -> Any:
        """Give a sequential runner (running the model itself, not a compiled copy)
        DDP's overlapped reduction; other runners (model parallel, compiled, with
        replica-grouped weights, whose shapes change per replica) keep the reduction
        after the backward passes of the step."""
        per_replica = isinstance(runner, PerReplicaRunner)
        inner = runner.inner if per_replica else runner
        if not isinstance(inner, SequentialRunner) or inner.forward is not self.model:
            return runner
        if per_replica and any(isinstance(s, GroupedParameter) for s in runner.states):
            return runner
        # DDP takes over after the first step (``ddp`` module docstring).
        self.ddp_runner = SyncOnLastMicrobatch(inner, self.params, per_step)
        self.device = device
        if per_replica:
            runner.inner = self.ddp_runner
            return runner
        return self.ddp_runner

    def release(self) -> None:
        """Free DDP while ``self.world`` still holds the process group: DDP's C++
        reducer must not drop the last reference to it, as that destroys the group with
        the GIL held and can deadlock with gloo's worker threads (pytorch#56297). Called
        when this object goes, and for every live one at exit."""
        runner = self.__dict__.get("ddp_runner")
        if runner is not None:
            runner.inner.forward = None
            runner.ddp = None
            self.ddp_runner = None
            self.reducer = None

    def __del__(self) -> None:
        self.release()

    def begin_step(self) -> None:
        """Before the micro-batches of a training step."""
        if self.ddp_runner is not None:
            self.ddp_runner.begin_step()

    def start_identical(self, optimizer: Any | None) -> None:
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
        """Sum this step's gradients over all processes (done already by DDP during
        the backward pass when the runner uses it)."""
        if self.reducer is None:
            return
        agreement = self.agreement
        totals = self.reducer(agreement.local_values() if agreement is not None else ())
        if agreement is not None:
            # (if the processes leave the compiled backend here, DDP attaches at a later
            # step, once every process has run an eager step)
            agreement.settle(totals)
            return
        runner = self.ddp_runner
        if runner is not None and runner.ddp is None and runner.last_used is not None:
            used = torch.tensor(runner.last_used, dtype=torch.float32)
            with failures_as_errors("Comparing the parameters used by each process"):
                dist.all_reduce(used, group=self.world.group)
            all_used = bool((used == self.world.size).all())
            find_unused = not all_used or find_unused_forced()
            runner.attach(
                make_ddp(self.model, self.world.group, self.device, find_unused),
                find_unused)
            self.reducer = None
            self.averaged_over = self.world.size

    def sync_buffers(self) -> None:
        """Send process 0's buffers to every process (no-op without broadcastBuffers)."""
        if self.buffers:
            broadcast_([b.data for b in self.buffers], self.world.group)
