"""The interpreter of a one-stage step: the micro-batches of a step as a schedule of
actions, run in the calling thread.

A program without model parallelism runs every micro-batch of a step on one device, one
after another. Its schedule (``schedules.one_stage_schedule``) is a list of
:class:`~poptorch._runtime.schedule.actions.Action`:

* ``LOAD`` (lane ``k``): replica ``k``'s own state made current before its micro-batch
  (its buffers, its group's slice of replica-grouped weights), when replicas are
  simulated on one device;
* ``F`` / ``B``: the micro-batch's forward pass and (training) its backward pass, run by
  the :py:class:`Compute` of the backend in force (the eager model, or the compiled
  micro-batch of ``fused_microbatch.py``);
* ``ALL_REDUCE`` before the last micro-batch of a step: its backward pass sums the
  gradients over the processes as it runs (DDP's overlapped buckets; ``GradientSync``);
* ``STORE`` (lane ``k``): what the micro-batch left in the lane's state is kept there
  (the gradient of a replica-grouped weight goes to its group's slice);
* ``BROADCAST`` after each step: replica 0's buffers sent to every replica
  (``broadcastBuffers``);
* ``DROP`` at the end: the per-replica views dropped, the model left on replica 0.

Pipelines, sharded and phased models have schedules of several stages run by the
per-device engine (``_runtime/placement/``); local replicas on several GPUs run their
lanes concurrently (``concurrent_replicas.py``).
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from ..._typing import UserOutput
from ..batching.plan import Microbatch
from ..schedule.actions import Action, ActionKind
from ..schedule.schedules import one_stage_schedule
from .concurrent_replicas import ReplicaCopies
from .overlapped_io import FirstForwardCheck
from .runner import LossOf, ReplicaState, drop_history

__all__ = ["Compute", "EagerCompute", "GradientSync", "Interpreter", "MicrobatchObserver"]

F, B = ActionKind.FORWARD, ActionKind.BACKWARD
LOAD, STORE, DROP = ActionKind.LOAD, ActionKind.STORE, ActionKind.DROP
ALL_REDUCE, BROADCAST = ActionKind.ALL_REDUCE, ActionKind.BROADCAST


class Compute(Protocol):
    """How the compute actions of one micro-batch run (a backend's piece).

    ``forward`` is the ``F`` action: the output (in training, with what its backward
    pass needs); ``backward`` the ``B`` action: gradients accumulated into ``.grad``."""

    def forward(self, args: tuple, kwargs: dict, loss_of: LossOf | None) -> UserOutput:
        ...

    def backward(self, output: UserOutput, loss_of: LossOf) -> None:
        ...


class EagerCompute:
    """The model itself: ``F`` runs ``forward`` (the first one under the overlap
    markers' ``check``), ``B`` runs autograd from the output's loss."""

    def __init__(self, forward: Callable[..., UserOutput],
                 check: FirstForwardCheck | None = None) -> None:
        self.forward_fn = forward
        self.check = check

    def forward(self, args: tuple, kwargs: dict, loss_of: LossOf | None) -> UserOutput:
        check = self.check
        if check is None:
            return self.forward_fn(*args, **kwargs)
        out = check.run(self.forward_fn, args, kwargs)
        self.check = None
        return out

    def backward(self, output: UserOutput, loss_of: LossOf) -> None:
        loss_of(output).backward()


class GradientSync(Protocol):
    """The processes' gradient reduction inside the backward pass (DDP,
    ``distributed/ddp.DdpSync``): the ``F`` and ``B`` actions of a micro-batch run in
    its scopes, ``reduce=True`` for the micro-batch after an ``ALL_REDUCE`` action."""

    def forward_scope(self, reduce: bool) -> contextlib.AbstractContextManager[object]:
        ...

    def backward_scope(self, reduce: bool) -> contextlib.AbstractContextManager[object]:
        ...


class MicrobatchObserver(Protocol):
    """Watches the forward actions (profiling: ``tracing.StepTrace``)."""

    def forward(self, microbatch: int, replica: int) -> contextlib.AbstractContextManager[object]:
        ...


class Interpreter:
    """Runs one-stage schedules in the calling thread (module docstring); callable as a
    step runner: ``interpreter(microbatches, loss_of) -> outputs``."""

    def __init__(self, compute: Compute, *, buffers: Sequence[torch.Tensor] = (),
                 per_step: int = 1, replicas: int = 1) -> None:
        self.compute = compute
        self.buffers = tuple(buffers)  # history dropped before each training micro-batch
        self.per_step = per_step  # micro-batches of one step (optimizer step, iteration)
        self.replicas = replicas  # micro-batch n runs on lane n % replicas
        self.states: tuple[ReplicaState, ...] = ()
        self.broadcast = False
        # Set once, at compile time, by what the schedule serves: the processes' DDP
        # reduction (``distributed/``) and the profiler (``tracing.StepTrace``).
        self.sync: GradientSync | None = None
        self.observer: MicrobatchObserver | None = None
        self.copies: ReplicaCopies | None = None  # lanes on devices of their own
        self._lane_computes: list[Compute] = []
        self._schedules: dict[tuple[int, bool, bool], list[Action]] = {}

    def use_lanes(self, states: Sequence[ReplicaState], broadcast: bool) -> None:
        """Give each lane its own ``states``; ``broadcast``: replica 0's buffers to
        every lane after each step. Called once, at compile time."""
        self.states, self.broadcast = tuple(states), broadcast
        self._schedules.clear()

    def run_lanes_on(self, copies: ReplicaCopies) -> None:
        """Run each replica's lane on its own model copy, device and thread
        (``concurrent_replicas.py``). Called once, at compile time."""
        self.copies = copies
        self._schedules.clear()

    # ------------------------------------------------------------------ the schedule
    def schedule(self, count: int, training: bool) -> list[Action]:
        """The actions of a runner call with ``count`` micro-batches (cached)."""
        key = (count, training, self.sync is not None)
        actions = self._schedules.get(key)
        if actions is None:
            copies = self.copies
            actions = self._schedules[key] = one_stage_schedule(
                count, training, self.replicas, self.per_step, bool(self.states),
                self.broadcast if copies is None else copies.broadcast_each_step,
                self.sync is not None, lane_copies=copies is not None)
        return actions

    def __call__(self, microbatches: list[Microbatch],
                 loss_of: LossOf | None) -> list[UserOutput]:
        if not self.states and self.sync is None and self.observer is None \
                and self.copies is None:
            # nothing per replica, no reduction inside the backward pass: the schedule
            # is F (then B) of each micro-batch in turn, run without the dispatch
            compute, buffers = self.compute, self.buffers
            plain = []
            for args, kwargs in microbatches:
                if loss_of is not None and buffers:
                    drop_history(buffers)
                out = compute.forward(args, kwargs, loss_of)
                if loss_of is not None:
                    compute.backward(out, loss_of)
                plain.append(out)
            return plain
        if self.copies is not None:
            return self._run_copies(self.copies, microbatches, loss_of)
        outputs: list[UserOutput] = []
        training = loss_of is not None
        try:
            self._run(self.schedule(len(microbatches), training), microbatches, loss_of,
                      outputs)
        except BaseException:
            self._drop(training)  # (a failed micro-batch leaves replica 0's state too)
            raise
        return outputs

    def _drop(self, training: bool) -> None:
        """The ``DROP`` action: the per-replica views dropped, replica 0's state in
        place, the grouped weights' gradients gathered."""
        for state in self.states:
            state.restore(training)

    def _run_copies(self, copies: ReplicaCopies, microbatches: list[Microbatch],
                    loss_of: LossOf | None) -> list[UserOutput]:
        """The schedule with each lane's compute actions on its own copy and thread,
        the lanes' ``ALL_REDUCE`` / ``BROADCAST`` after each step in this thread."""
        copies.prepare()
        if not self._lane_computes:
            self._lane_computes = [self.compute] + [
                EagerCompute(model) for model in copies.replicas[1:]]
        actions = self.schedule(len(microbatches), loss_of is not None)
        outputs: list[UserOutput] = [None] * len(microbatches)
        pending: list[Action] = []  # the lanes' compute actions up to the next step end
        for action in actions:
            if action.lane >= 0:
                pending.append(action)
                continue
            self._run_lanes(copies, pending, microbatches, loss_of, outputs)
            pending = []
            if action.kind is ALL_REDUCE:
                copies.gather_grads()
            elif action.kind is BROADCAST:
                copies.broadcast()
        self._run_lanes(copies, pending, microbatches, loss_of, outputs)
        return outputs

    def _run_lanes(self, copies: ReplicaCopies, actions: list[Action],
                   microbatches: list[Microbatch], loss_of: LossOf | None,
                   outputs: list[UserOutput]) -> None:
        """``actions`` (compute actions of every lane) with the lanes at once."""
        if not actions:
            return

        def lane(k: int) -> list[tuple[int, UserOutput]]:
            return self._run_lane(copies, k, actions, microbatches, loss_of)
        for lane_outputs in copies.run(lane):
            for n, out in lane_outputs:
                outputs[n] = out

    def _run_lane(self, copies: ReplicaCopies, k: int, actions: list[Action],
                  microbatches: list[Microbatch], loss_of: LossOf | None
                  ) -> list[tuple[int, UserOutput]]:
        """Lane ``k``'s compute actions among ``actions``, on its copy."""
        compute = self._lane_computes[k]
        outputs: dict[int, UserOutput] = {}
        with torch.set_grad_enabled(loss_of is not None):
            for kind, _, n, lane in actions:
                if lane != k:
                    continue
                if kind is F:
                    args, kwargs = copies.moved_in(k, microbatches[n])
                    with torch.profiler.record_function(
                            f"poptorch::micro-batch {n % self.per_step} replica {k}"):
                        outputs[n] = compute.forward(args, kwargs, loss_of)
                elif kind is B:
                    assert loss_of is not None  # (training schedules only)
                    compute.backward(outputs[n], loss_of)
        return [(n, copies.moved_home(k, out)) for n, out in outputs.items()]

    def _run(self, actions: list[Action], microbatches: list[Microbatch],
             loss_of: LossOf | None, outputs: list[UserOutput]) -> None:
        compute, states, sync, observer = self.compute, self.states, self.sync, self.observer
        reduce = False  # the current micro-batch follows an ALL_REDUCE
        for kind, _, n, lane in actions:
            if kind is F:
                if loss_of is not None and self.buffers:
                    drop_history(self.buffers)
                args, kwargs = microbatches[n]
                with contextlib.ExitStack() as scopes:
                    if sync is not None and loss_of is not None:
                        scopes.enter_context(sync.forward_scope(reduce))
                    if observer is not None:
                        scopes.enter_context(observer.forward(n % self.per_step, lane))
                    outputs.append(compute.forward(args, kwargs, loss_of))
            elif kind is B:
                assert loss_of is not None  # (training schedules only)
                if sync is None:
                    compute.backward(outputs[n], loss_of)
                else:
                    with sync.backward_scope(reduce):
                        compute.backward(outputs[n], loss_of)
                reduce = False
            elif kind is LOAD:
                for state in states:
                    state.select(lane)
            elif kind is STORE:
                for state in states:
                    state.after_microbatch(lane, loss_of is not None)
            elif kind is BROADCAST:
                for state in states:
                    state.end_step()
            elif kind is ALL_REDUCE:
                reduce = True
            elif kind is DROP:
                self._drop(loss_of is not None)
