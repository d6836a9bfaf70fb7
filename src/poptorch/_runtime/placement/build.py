"""Model parallelism: the step runner of the four execution strategies.

The runner :func:`build_runner` returns captures the model's graph (``capture.py``: at
once with an example call, else on the first call), resolves the partition
(``partition.resolve_partition``, which enforces the rules), acquires the devices
playing the IPUs, places every stage's weights and splits the graph into stage
modules, which the per-device engine (``engine.py``) runs on every call with the
strategy's schedule (``_runtime/schedule/schedules.py``):

* ``PipelinedExecution``: one worker per device runs its stages' actions (1F1B when
  training, or what ``setSchedule`` asks; GPipe for inference), so stages of different
  micro-batches run at once on different devices;
* ``ShardedExecution``: stage after stage, one device busy at a time;
* ``SerialPhasedExecution`` / ``ParallelPhasedExecution``: phase after phase (parallel:
  the even and the odd devices take turns), weights streamed between host and devices
  by the schedule's ``LOAD`` / ``STORE`` actions (``phased.StreamingMemory``).

What the engine cannot run (a model that cannot be captured, phases of several stages,
a sharded stage revisited, a call whose non-tensor arguments differ from the captured
ones) runs the sharded action list in the calling thread with the model's own forward
(``sequential.py``), with one INFO line per model saying why. The overlap markers are
checked on the captured graph (``io_markers.py``), or on the first forward of a model
that was not captured (``FirstForwardCheck``). The schedule a step ran is kept in
``runner.last_schedule`` and ``strategy.last_schedule`` (a ``ScheduleRecord``).
"""
from __future__ import annotations

import inspect
import itertools
import re

import torch

from ..._logging import info_once
from ..._typing import UserOutput
from ..config import RuntimeConfig
from ..program.interpreter import EagerCompute, Interpreter
from ..program.overlapped_io import FirstForwardCheck, OverlapSettings
from ..program.runner import LossOf
from ..schedule import schedules
from ..schedule.actions import Action, ActionKind
from ..schedule.timeline import SEQUENTIAL, ScheduleRecord, Timeline
from . import recompute
from .capture import CapturedModel, CaptureUnsupported, capture
from .engine import Engine
from .partition import (
    Partition,
    has_static_annotations,
    is_pipelined,
    resolve_partition,
    trace_blocks,
)
from .phased import StreamingMemory
from .sequential import run_in_calling_thread, units_of
from .stages import split_stages
from .strategy import (
    PARALLEL_PHASED,
    PIPELINED,
    SHARDED,
    ExecutionStrategy,
    is_phased,
    publish_schedule,
    schedule_name,
)

# Whole words only: ``poptorch.Block(``, ``Block.start``, ``BlockFunction``, ``ipu.IPU(``,
# not a user's ``ResBlock(`` or ``BeginBlock(``.
_BLOCK_WORDS = re.compile(r"(?<![\w])(Block\s*\(|Block\.start|BlockFunction\b|IPU\s*\()")


def build_runner(model: torch.nn.Module, config: RuntimeConfig, training: bool,
                 devices: list[torch.device] | None = None,
                 example: tuple | None = None,
                 overlap: OverlapSettings | None = None
                 ) -> ModelParallelRunner | None:
    """A runner for the model's execution strategy (``config.placement.strategy``), or
    None when the model has no block annotations and no strategy was set (it then runs
    on one device). With ``example`` (``(args, kwargs)`` of a call) the model is
    captured and split now, so its devices and weights' placement are known before the
    weight sync and the optimizer are built; else on the first call. ``overlap``: the
    options the overlap markers' rules read (None: not checked)."""
    if not config.placement.strategy_given and not (
            has_static_annotations(model) or _forward_uses_blocks(model)):
        return None
    runner = ModelParallelRunner(model, config, training, config.placement.strategy,
                                 devices, overlap)
    if example is not None:
        runner.compile_captured(*example)
    return runner


def _forward_uses_blocks(model: torch.nn.Module) -> bool:
    """Whether some ``forward`` of the model mentions Block / BlockFunction / IPU (these
    annotations only show when the model runs; the first call then checks for real)."""
    seen = set()
    for module in model.modules():
        cls = type(module)
        if cls in seen or cls.__module__.startswith("torch."):
            continue
        seen.add(cls)
        try:
            source = inspect.getsource(cls)
        except (OSError, TypeError):
            continue
        if _BLOCK_WORDS.search(source):
            return True
    return False


_serials = itertools.count()  # one per runner: the key of its INFO line


class ModelParallelRunner:
    """StepRunner for the execution strategies (module docstring)."""

    def __init__(self, model: torch.nn.Module, config: RuntimeConfig, training: bool,
                 strategy: ExecutionStrategy,
                 devices: list[torch.device] | None = None,
                 overlap: OverlapSettings | None = None) -> None:
        self.model = model
        self.config = config
        self.training = training
        self.strategy = strategy
        self.overlap = overlap
        self.partition: Partition | None = None
        # acquired with the partition when not given
        self.devices: list[torch.device] | None = devices
        self.streaming: StreamingMemory | None = None
        self.last_schedule: ScheduleRecord | None = None
        self.engine: Engine | None = None
        self.captured: CapturedModel | None = None
        # without a stage to place: the default runner's sequence on the one device
        self._plain: Interpreter | None = None
        # a model that was not captured: its overlap markers checked on its first forward
        self._check: FirstForwardCheck | None = None
        self._why_sequential = ""  # why the engine cannot run this model
        self._capture_tried = False
        self._plans: dict[tuple[int, bool], Timeline] = {}
        self._serial = next(_serials)
        # Thread-local contexts of the program (set by the device loop), entered in
        # every worker thread.
        self.worker_contexts: list = []
        from ... import _devices  # pylint: disable=import-outside-toplevel
        self.input_device = devices[0] if devices else _devices.ipu_device(
            0, config.placement.device_options)

    # ------------------------------------------------------------------ compile
    def compile_captured(self, args: tuple, kwargs: dict) -> Partition | None:
        """Capture the model's graph, check its overlap markers, resolve the partition
        and split the graph into the stage modules the engine runs; None when the model
        cannot be captured (the first call then finds its blocks by running it)."""
        self._capture_tried = True
        try:
            captured = capture(self.model, args, kwargs, self.strategy, self.overlap,
                               fx_first=self.config.placement.module_calls_rewritten)
        except CaptureUnsupported as exc:
            self._why_sequential = f"it cannot be captured as a graph ({exc})"
            return None
        part = resolve_partition(captured.trace, self.strategy, self.config, self.training)
        self.captured = captured
        staged = None
        if is_phased(self.strategy) and part.num_stages != part.num_phases:
            self._why_sequential = (f"its {part.num_phases} phases hold "
                                    f"{part.num_stages} stages")
        elif not self._is_plain(part):
            try:
                staged = split_stages(captured, part)
            except ValueError as exc:  # a sharded stage revisited
                self._why_sequential = f"its stages cannot be split apart ({exc})"
        self._set_partition(part)
        if staged is not None:
            assert self.devices is not None  # (set with the partition)
            self.engine = Engine(staged, [st.ipu for st in part.stages], self.devices)
        return part

    def compile(self, microbatch: tuple) -> Partition:
        """Set up the partition on the first call's first micro-batch: from the captured
        graph, or, when the model cannot be captured, from a run of its forward."""
        args, kwargs = microbatch
        if not self._capture_tried:
            part = self.compile_captured(args, kwargs)
            if part is not None:
                return part
        trace = trace_blocks(self.model, args, kwargs, self.strategy)
        part = resolve_partition(trace, self.strategy, self.config, self.training)
        self._set_partition(part)
        return part

    def _is_plain(self, part: Partition) -> bool:
        """No stage to place: no block, or a ``PipelinedExecution`` on one IPU (not
        pipelined, as upstream)."""
        return not is_phased(self.strategy) and (not part.has_blocks or (
            self.strategy.schedule_kind == PIPELINED and part.num_ipus == 1))

    def _set_partition(self, part: Partition) -> None:
        """Adopt ``part``: acquire the devices, place the weights on them and make the
        runners of the calls the engine does not run."""
        self.partition = part
        if self.devices is None:
            from ... import _devices  # pylint: disable=import-outside-toplevel
            self.devices = _devices.acquire_devices(self.config.placement.device_options,
                                                    part.num_ipus)
        elif len(self.devices) < part.num_ipus:
            from ...errors import Error  # pylint: disable=import-outside-toplevel
            raise Error(f"The model needs {part.num_ipus} IPUs but only "
                        f"{len(self.devices)} devices were given.")
        if is_phased(self.strategy):
            self.streaming = StreamingMemory(self.model, part, self.devices,
                                             self.config.placement)
        else:
            self._place_weights(part)
        # the markers of a model that was not captured: checked on its first forward
        check = FirstForwardCheck(self.overlap) \
            if self.overlap is not None and self.captured is None else None
        if self._is_plain(part):
            self._plain = Interpreter(EagerCompute(self.model, check))
        else:
            self._check = check

    def _place_weights(self, part: Partition) -> None:
        assert self.devices is not None  # (set with the partition)
        with torch.no_grad():
            for t in list(self.model.parameters()) + list(self.model.buffers()):
                stage = part.weight_stage.get(id(t))
                if stage is not None:
                    device = self.devices[part.stages[stage].ipu]
                    if t.device != device:
                        t.data = t.data.to(device)

    # ------------------------------------------------------------------ run
    def __call__(self, microbatches: list[tuple], loss_of: LossOf | None
                 ) -> list[UserOutput]:
        if self.partition is None:
            self.compile(microbatches[0])
        if self._plain is not None:
            return self._plain(microbatches, loss_of)
        why = self._why_sequential
        if self.engine is not None and microbatches:
            captured = self.captured
            assert captured is not None  # (set together with the engine)
            inputs = [captured.inputs_of(args, kwargs) for args, kwargs in microbatches]
            ready = [i for i in inputs if i is not None]
            if len(ready) == len(inputs):
                return self._run_engine(ready, loss_of)
            why = ("a micro-batch's non-tensor arguments differ from those the model "
                   "was captured with")
        return self._run_sequential(microbatches, loss_of, why)

    def _run_sequential(self, microbatches: list[tuple], loss_of: LossOf | None,
                        why: str) -> list[UserOutput]:
        """The sharded action list in this thread, with the model's own forward
        (``sequential.py``)."""
        part = self.partition
        assert part is not None and self.devices is not None  # (compiled before any run)
        if microbatches:
            info_once(("placement-sequential", self._serial),
                      "Model parallelism: %s runs its stages one after another in the "
                      "calling thread, not on the per-device engine: %s.",
                      type(self.model).__name__, why)
        if self.captured is not None and self.captured.checkpoints:
            recompute.hook_model(self.model)  # record whole forwards in segments
        units = max(units_of(part, self.streaming is not None)) + 1
        ops = schedules.sharded(units, len(microbatches), loss_of is not None)
        record = ScheduleRecord(units, runtime=SEQUENTIAL)
        record.plan = Timeline.of("sharded", [ops], schedules.Topology.chain(units))
        outputs = run_in_calling_thread(ops, self._forward, part, self.devices,
                                        self.streaming, microbatches, loss_of, record)
        self._keep(record)
        return outputs

    def _forward(self, args: tuple, kwargs: dict) -> UserOutput:
        check = self._check
        return (self.model(*args, **kwargs) if check is None
                else check.run(self.model, args, kwargs))

    def plan(self, count: int, training: bool) -> Timeline:
        """The schedule of a step of ``count`` micro-batches on the engine: its action
        list per device (one lane, run in this thread, for sharded and serial phases)."""
        key = (count, training)
        timeline = self._plans.get(key)
        if timeline is not None:
            return timeline
        part, engine = self.partition, self.engine
        assert part is not None and engine is not None  # (compiled before any run)
        assert self.devices is not None
        n, kind = part.num_stages, self.strategy.schedule_kind
        topo = schedules.Topology(tuple(map(tuple, engine.producers)),
                                  tuple(map(tuple, engine.consumers)))
        if kind == PARALLEL_PHASED:
            name = "parallel phased"
            lanes = schedules.parallel_phased(n, count, training, engine.stage_device,
                                              len(self.devices))
        elif is_phased(self.strategy):
            name = "serial phased"
            lanes = [schedules.serial_phased(list(range(n)), count, training)]
        elif kind == SHARDED or not is_pipelined(part):
            name = "sharded"
            lanes = [schedules.sharded(n, count, training)]
        else:
            name = schedule_name(self.strategy)
            lanes = schedules.pipeline_lanes(name, topo, engine.stage_device,
                                             len(self.devices), count, training)
        timeline = self._plans[key] = Timeline.of(name, lanes, topo)
        return timeline

    def _run_engine(self, inputs: list[dict], loss_of: LossOf | None
                    ) -> list[UserOutput]:
        part, engine = self.partition, self.engine
        assert part is not None and engine is not None  # (compiled before any run)
        engine.worker_contexts = self.worker_contexts
        plan = self.plan(len(inputs), loss_of is not None)
        lanes = [list(lane) for lane in plan.lanes]
        record = ScheduleRecord(part.num_stages, plan=plan, topology=plan.topology)
        if is_phased(self.strategy):
            outputs = self._run_engine_phased(lanes, inputs, loss_of, record)
        elif len(lanes) == 1:  # sharded: one device busy at a time, in this thread
            outputs = engine.run_in_order(lanes[0], inputs, loss_of, record)
        else:
            outputs = engine.run_lanes(lanes, inputs, loss_of, record)
        self._keep(record)
        return outputs

    def _run_engine_phased(self, lanes: list[list[Action]], inputs: list[dict],
                           loss_of: LossOf | None, record: ScheduleRecord
                           ) -> list[UserOutput]:
        """Phases (one stage each) on the engine: serial phases in this thread, parallel
        phases on the even / odd devices' workers; the schedule's ``LOAD`` / ``STORE``
        actions stream a phase's weights in and out (``StreamingMemory``)."""
        part, engine, streaming = self.partition, self.engine, self.streaming
        assert part is not None and engine is not None and streaming is not None
        devices = self.devices
        assert devices is not None

        def memory(op: Action) -> None:
            phase = part.stages[op.stage].phase or 0  # (set in phased partitions)
            (streaming.load if op.kind == ActionKind.LOAD else streaming.store)(phase)

        scope = lambda: streaming.activation_scope(devices)  # noqa: E731
        try:
            if self.strategy.schedule_kind == PARALLEL_PHASED:
                return engine.run_lanes(lanes, inputs, loss_of, record, memory, (scope, ))
            with scope():
                return engine.run_in_order(lanes[0], inputs, loss_of, record, cut=True,
                                           memory=memory)
        finally:
            streaming.offload_all()  # (a failed step's loaded phases too)

    def _keep(self, record: ScheduleRecord) -> None:
        """Publish the schedule just run, on the runner and on the strategy object the
        user made (the options hold a copy of it; see ``strategies._origin``)."""
        self.last_schedule = record
        publish_schedule(self.strategy, record)
