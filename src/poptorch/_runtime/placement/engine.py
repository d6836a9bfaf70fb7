"""The in-process execution engine: stage modules run by one worker per device.

``torch.distributed.pipelining`` runs one stage per process and moves activations with
send / recv. Here all stages live in one process: each device (an IPU played by a GPU
or a "virtual IPU" on the CPU) has one long-lived :class:`DeviceWorker` thread that
runs its action list (``_runtime/schedule/schedules.py``) in order, and activations
cross stages through a mailbox (:class:`_Step`), as ``PipelineStage.forward_one_chunk``
/ ``backward_one_chunk`` do:

* forward: inputs from earlier stages are *detached* copies on the stage's device with
  ``requires_grad`` (the boundary); the last stage also rebuilds the model's output and
  computes the loss;
* backward: ``torch.autograd.backward`` of the stage's own graph from the loss and from
  the gradients later stages left on their boundary copies. An input half (``"I"``,
  :mod:`.split_backward`) hands the input gradients over first; its weight half
  (``"W"``) runs later on the same lane;
* ``LOAD`` / ``STORE`` (phased execution): run by the step's ``memory`` handler.

CPU workers each take ``cores / devices`` intra-op threads (``torch.set_num_threads``
in a thread sets that thread's OpenMP team only; measured), so stages on different
cores run at once: the kernels release the GIL. CUDA workers run on one stream per
device and order cross-device reads with events (not verified on a GPU here).
"""
from __future__ import annotations

import contextlib
import functools
import os
import queue
import threading
import time
import weakref
from collections.abc import Callable
from typing import TypeVar

import torch

from ..._typing import UserInput, UserOutput
from .. import context
from ..program.runner import LossOf
from ..schedule.actions import MEMORY, Action, ActionKind
from ..schedule.schedules import handed_over
from ..schedule.timeline import ScheduleEvent, ScheduleRecord
from ..torch_internals import pytree
from . import recompute, split_backward
from .stagerun import cut_copy
from .stages import StagedModel

_T = TypeVar("_T")

FORWARD, BACKWARD = ActionKind.FORWARD, ActionKind.BACKWARD
INPUT_HALF, WEIGHT_HALF = ActionKind.INPUT_HALF, ActionKind.WEIGHT_HALF
#: What no other action waits for: a weight half, a memory action (lane order only).
_NOT_HANDED_OVER = MEMORY | {WEIGHT_HALF}

#: Runs a schedule's memory actions (``LOAD`` / ``STORE`` of a stage's weights).
MemoryHandler = Callable[[Action], None]

#: Longest time a worker waits for the actions its next action depends on before
#: declaring the schedule stalled.
WAIT_TIMEOUT_S = 600.0


class _Aborted(Exception):
    """Raised in a worker once another worker of the step failed."""


def cpu_cores() -> int:
    """Cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


class DeviceWorker:
    """One long-lived thread running the work of one device, in order."""

    def __init__(self, index: int, device: torch.device, threads: int) -> None:
        self.index = index
        self.device = device
        self.threads = threads
        self.stream = (torch.cuda.Stream(device) if device.type == "cuda" else None)
        self._tasks: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=f"poptorch-device-{index}",
                                        daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        if self.device.type == "cpu":
            torch.set_num_threads(self.threads)  # this thread's team only
        elif self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        while True:
            task = self._tasks.get()
            if task is None:
                return
            task()

    def submit(self, task: Callable[[], None]) -> None:
        self._tasks.put(task)

    def stop(self) -> None:
        self._tasks.put(None)

    def join(self, timeout: float) -> None:
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)


def _stop_all(workers: list[DeviceWorker]) -> None:
    """Stop the workers and wait for them (also at interpreter exit: a thread still in
    torch when the interpreter finalizes aborts the process)."""
    for worker in workers:
        worker.stop()
    for worker in workers:
        worker.join(5.0)


class Engine:
    """Runs a :class:`~.stages.StagedModel` over its devices (module docstring)."""

    def __init__(self, staged: StagedModel, stage_device: list[int],
                 devices: list[torch.device]) -> None:
        self.staged = staged
        self.stage_device = stage_device
        self.devices = devices
        self.producers = [s.producers for s in staged.stages]
        self.consumers = [s.consumers for s in staged.stages]
        self.weights = [list(s.module.parameters()) for s in staged.stages]
        self._used = sorted(set(stage_device))
        cpu_lanes = sum(1 for d in self._used if devices[d].type == "cpu")
        self._threads = max(1, cpu_cores() // max(1, cpu_lanes))
        self.workers: dict[int, DeviceWorker] = {}
        self._finalizer: weakref.finalize | None = None
        self.worker_contexts: list = []

    def _ensure_workers(self) -> None:
        if self.workers:
            return
        for d in self._used:
            self.workers[d] = DeviceWorker(d, self.devices[d], self._threads)
        self._finalizer = weakref.finalize(self, _stop_all, list(self.workers.values()))

    def close(self) -> None:
        """Stop the workers (they also stop when the engine is garbage collected)."""
        if self._finalizer is not None:
            self._finalizer()
        self.workers = {}

    # ---------------------------------------------------------------- pipelined
    def run_lanes(self, lanes: list[list[Action]], inputs: list[dict[str, UserInput]],
                  loss_of: LossOf | None,
                  record: ScheduleRecord, memory: MemoryHandler | None = None,
                  contexts: tuple = ()) -> list[UserOutput]:
        """Run ``lanes`` (one action list per device, ``lanes[d]`` on device ``d``),
        each on its device's worker; returns the model's outputs per micro-batch.
        ``memory`` runs the memory actions (phased streaming); ``contexts`` are extra
        context factories entered by each worker for the call."""
        self._ensure_workers()
        step = _Step(self, inputs, loss_of, cut=True, record=record)
        step.memory, step.contexts = memory, list(contexts)
        step.training = context.is_running_training()  # (the caller's: a training run)
        grad = torch.is_grad_enabled()
        busy = [(d, lane) for d, lane in enumerate(lanes) if lane]
        step.lanes = len(busy)
        for d, lane in busy:
            self.workers[d].submit(functools.partial(step.run_lane, d, lane, grad))
        step.wait()
        return step.results

    # ---------------------------------------------------------------- sharded
    def run_in_order(self, ops: list[Action], inputs: list[dict[str, UserInput]],
                     loss_of: LossOf | None,
                     record: ScheduleRecord, cut: bool = False,
                     memory: MemoryHandler | None = None) -> list[UserOutput]:
        """Run ``ops`` in this thread, one device busy at a time. Uncut (sharded), the
        stages of a micro-batch form one autograd graph and its backward is one call
        from the loss; cut (serial phases), each backward action runs its stage's."""
        step = _Step(self, inputs, loss_of, cut=cut, record=record)
        step.memory = memory
        for op in ops:
            step.run_op(0, op)
        return step.results


class _Step:
    """The mailbox and the bookkeeping of one runner call."""

    def __init__(self, engine: Engine, inputs: list[dict[str, UserInput]],
                 loss_of: LossOf | None, cut: bool,
                 record: ScheduleRecord) -> None:
        self.engine = engine
        self.staged = engine.staged
        self.inputs = inputs
        self.loss_of = loss_of
        self.cut = cut
        self.record = record
        self.last = len(self.staged.stages) - 1
        self.results: list[UserOutput] = [None] * len(inputs)
        self.outputs: dict[tuple[int, int], tuple] = {}
        self.crossed: dict[tuple[int, int], dict[int, list]] = {}  # (s, m) -> producer -> pairs
        self.losses: dict[int, torch.Tensor] = {}
        self.halves: dict[tuple[int, int], split_backward.SplitBackward] = {}
        self.events: dict[Action, torch.cuda.Event] = {}  # CUDA events of finished actions
        self.done: set = set()
        self.cond = threading.Condition()
        self.error: BaseException | None = None
        self.finished = 0
        self.lanes = 0
        self.memory: MemoryHandler | None = None
        self.contexts: list = []
        self.training = False
        self.all_finished = threading.Event()  # the driver waits on this alone

    # ------------------------------------------------------------ worker side
    def run_lane(self, d: int, lane: list[Action], grad: bool) -> None:
        worker = self.engine.workers[d]
        try:
            with torch.set_grad_enabled(grad), context.running_on_ipu(self.training), \
                    context.worker_scope(self.engine.worker_contexts + self.contexts), \
                    _on_stream(worker):
                for op in lane:
                    self._wait_for(op)
                    self.run_op(d, op)
                    if op.kind not in _NOT_HANDED_OVER:
                        with self.cond:
                            self.done.add(handed_over(op))
                            self.cond.notify_all()
                if worker.stream is not None:
                    worker.stream.synchronize()
                context.take_marked_losses()
        except _Aborted:
            pass
        except BaseException as exc:  # pylint: disable=broad-except
            with self.cond:
                if self.error is None:
                    self.error = exc
        finally:
            with self.cond:
                self.finished += 1
                self.cond.notify_all()
                if self.finished == self.lanes:
                    self.all_finished.set()

    def _wait_for(self, op: Action) -> None:
        kind, s, m = op.kind, op.stage, op.microbatch
        if kind in _NOT_HANDED_OVER:  # (a weight half: after its input half, same lane)
            return
        deps = ([Action(FORWARD, p, m) for p in self.engine.producers[s]] if kind == FORWARD
                else [Action(BACKWARD, c, m) for c in self.engine.consumers[s]])
        if not deps:
            return
        deadline = time.monotonic() + WAIT_TIMEOUT_S
        with self.cond:
            while True:
                if self.error is not None:
                    raise _Aborted()
                if all(dep in self.done for dep in deps):
                    return
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    from ...errors import Error  # pylint: disable=import-outside-toplevel
                    raise Error(f"Pipeline schedule stalled: {kind}{m} of stage {s} waited "
                                f"{WAIT_TIMEOUT_S:.0f}s for {deps}.")
                self.cond.wait(min(remaining, 1.0))

    def wait(self) -> None:
        """Driver side: wait until every lane has finished; re-raise the first error."""
        self.all_finished.wait()
        if self.error is not None:
            raise self.error

    # ------------------------------------------------------------ actions
    def run_op(self, lane: int, op: Action) -> None:
        kind, s, m = op.kind, op.stage, op.microbatch
        if kind in MEMORY:
            assert self.memory is not None  # (only phased schedules move memory)
            self.memory(op)
            return
        event = ScheduleEvent(lane, BACKWARD if kind == INPUT_HALF else kind, s, m,
                              time.perf_counter())
        if kind == FORWARD:
            self._forward(s, m)
        elif kind == WEIGHT_HALF:
            half = self.halves.pop((s, m), None)
            if half is not None:  # (None: the input half ran the whole backward)
                half.weight_half()
        else:
            self._backward(s, m, split=kind == INPUT_HALF)
        event.end = time.perf_counter()
        with self.cond:
            (self.record.weight_events if kind == WEIGHT_HALF else
             self.record.events).append(event)

    def _forward(self, s: int, m: int) -> None:
        stage = self.staged.stages[s]
        device = self.engine.devices[self.engine.stage_device[s]]
        crossed: dict[int, list] = {}
        args = []
        for source in stage.sources:
            if source[0] == "input":
                args.append(_to(self.inputs[m][source[1]], device))
            else:
                _, p, pos = source
                self._wait_event(Action(FORWARD, p, m))
                value = self.outputs[(p, m)][pos]
                args.append(self._cross(value, device, crossed.setdefault(p, [])))
        if stage.checkpoints and self.loss_of is not None and torch.is_grad_enabled():
            with recompute.recording(stage.module):  # segments recomputed in backward
                out = stage.module(*args)
        else:
            out = stage.module(*args)
        self.outputs[(s, m)] = out
        if self.cut:
            self.crossed[(s, m)] = crossed
        self._record_event(Action(FORWARD, s, m))
        if s == self.last:
            self._finish_microbatch(m, args, out)

    def _finish_microbatch(self, m: int, args: list, out: tuple) -> None:
        staged = self.staged

        def value(source: tuple) -> UserOutput:
            if source[0] == "import":
                return args[source[1]]
            if source[0] == "stage":
                return out[source[2]]
            return source[1]

        output = pytree.tree_unflatten([value(src) for src in staged.output_sources],
                                       staged.output_spec)
        for src in staged.loss_sources:
            context.mark_loss(value(src))
        self.results[m] = output
        if self.loss_of is not None:
            loss = self.loss_of(output)
            if self.cut:
                self.losses[m] = loss
            else:  # sharded: one graph through every stage, backward from the loss
                loss.backward()

    def _backward(self, s: int, m: int, split: bool = False) -> None:
        """The backward of stage ``s`` on micro-batch ``m``; ``split``: its input half
        only when it can be split exactly (``split_backward``), the weight half kept
        for its ``W`` action."""
        if not self.cut:  # the loss's backward already ran through every stage
            return
        roots: dict[int, list] = {}
        if s == self.last:
            loss = self.losses.pop(m)
            roots[id(loss)] = [loss, None]
        for c in self.engine.consumers[s]:
            self._wait_event(Action(BACKWARD, c, m))
            for original, copy in self.crossed.get((c, m), {}).pop(s, []):
                if copy.grad is None:
                    continue
                grad = copy.grad.to(original.device)
                entry = roots.get(id(original))
                if entry is None:
                    roots[id(original)] = [original, grad]
                else:
                    entry[1] = grad if entry[1] is None else entry[1] + grad
        if roots:
            tensors = [r[0] for r in roots.values()]
            grads = [r[1] for r in roots.values()]
            half = None
            if split and not self.staged.stages[s].checkpoints:
                inputs = [copy for pairs in self.crossed.get((s, m), {}).values()
                          for _, copy in pairs]
                half = split_backward.plan(tensors, inputs, self.engine.weights[s])
            if half is None:
                torch.autograd.backward(tensors, grads)
            else:
                half.input_half(tensors, grads, inputs)
                self.halves[(s, m)] = half
        self._record_event(Action(BACKWARD, s, m))
        self.outputs.pop((s, m), None)

    def _cross(self, value: _T, device: torch.device, pairs: list) -> _T:
        """A producer's value as the consumer sees it: on its device and, in a cut
        pipeline, detached with ``requires_grad`` (the stage boundary)."""
        def cross(t: torch.Tensor) -> torch.Tensor:
            return cut_copy(t, device, pairs) if self.cut else t.to(device)
        return pytree.tree_map_only(torch.Tensor, cross, value)

    # ------------------------------------------------------------ CUDA ordering
    def _record_event(self, op: Action) -> None:
        worker = self.engine.workers.get(self.engine.stage_device[op.stage])
        if worker is not None and worker.stream is not None:
            event = torch.cuda.Event()
            event.record(worker.stream)
            self.events[op] = event

    def _wait_event(self, op: Action) -> None:
        event = self.events.get(op)
        if event is not None:
            torch.cuda.current_stream().wait_event(event)


def _to(value: _T, device: torch.device) -> _T:
    return pytree.tree_map_only(torch.Tensor, lambda t: t.to(device), value)


def _on_stream(worker: DeviceWorker) -> contextlib.AbstractContextManager[object]:
    """Make a CUDA worker's stream current while it runs its lane."""
    if worker.stream is None:
        return contextlib.nullcontext()
    return torch.cuda.stream(worker.stream)
