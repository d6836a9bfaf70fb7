"""Model parallelism: the step runners of the four execution strategies.

:func:`build_runner` is called by the executor at compile time. The returned runner
traces the model on its first call (``partition.trace_blocks``), resolves the
partition and enforces the rules (``partition.resolve_partition``), acquires the
devices playing the IPUs, places every stage's weights on its device, and then runs
each step with the strategy's schedule:

* ``PipelinedExecution``: a real pipeline. Each micro-batch runs in its own worker
  thread; the forward pass is cut at stage boundaries and every stage admits forward
  and backward ops of the micro-batches in 1F1B order (training; GPipe on request) or
  GPipe order, so stages of different micro-batches run at the same time.
* ``ShardedExecution``: stage after stage, one device busy at a time.
* ``SerialPhasedExecution`` / ``ParallelPhasedExecution``: phase after phase, weights
  streamed between host memory and the devices (``phased.StreamingMemory``).

The schedule a step executed is kept in ``runner.last_schedule`` and in
``strategy.last_schedule`` (a :class:`~.pipeline.ScheduleRecord`; ``print`` it).
"""
from __future__ import annotations

import inspect
import re
import threading
from contextlib import nullcontext
from typing import Any, Callable, List, Optional

import torch

from .strategy import (PARALLEL_PHASED, PIPELINED, SHARDED, ExecutionStrategy, is_phased,
                       kind_of, publish_schedule, schedule_name)
from .. import context
from ..config import PlacementConfig, RuntimeConfig
from ..._logging import logger
from .actions import defer_weight_halves, device_lanes, sharded_actions
from .capture import CapturedModel, capture
from .engine import Engine
from .partition import (Partition, has_static_annotations, is_pipelined, resolve_partition,
                        trace_blocks)
from .phased import StreamingMemory, parallel_phased_schedule
from .pipeline import (BACKWARD, FORWARD, LaneScheduler, ScheduleEvent, ScheduleRecord,
                       run_workers, sequential_schedule, stage_schedules)
from . import recompute
from .stagerun import StageRun, listening
from .stages import split_stages
from ..program.runner import SequentialRunner


LossOf = Callable[[Any], torch.Tensor]
# Whole words only: ``poptorch.Block(``, ``Block.start``, ``BlockFunction``, ``ipu.IPU(``,
# not a user's ``ResBlock(`` or ``BeginBlock(``.
_BLOCK_WORDS = re.compile(r"(?<![\w])(Block\s*\(|Block\.start|BlockFunction\b|IPU\s*\()")


def build_runner(model: torch.nn.Module, config: RuntimeConfig | Any, training: bool,
                 devices: Optional[List[torch.device]] = None,
                 example: Optional[tuple] = None) -> Optional["ModelParallelRunner"]:
    """A runner for the model's execution strategy, or None when the model has no block
    annotations and no strategy was set (the executor then runs it on one device).

    ``config`` is the compiled model's :class:`~poptorch._runtime.config.RuntimeConfig`
    (a ``poptorch.Options`` is frozen into one here); ``config.placement.strategy`` is
    the strategy in force. With ``example`` (``(args, kwargs)`` of a call), the model is
    captured and split now, so its devices and the placement of its weights are known
    before the weight sync and the optimizer are built; without it (or when the model
    cannot be captured) on the first call."""
    if not isinstance(config, RuntimeConfig):
        config = RuntimeConfig.of(config)
    if config.distributed.stages_on_processes:  # one process per stage (torchrun)
        from .processes import StageProcessRunner  # pylint: disable=import-outside-toplevel
        return StageProcessRunner(model, config, training, example)  # type: ignore
    if not config.placement.strategy_given and not (
            has_static_annotations(model) or _forward_uses_blocks(model)):
        return None
    runner = ModelParallelRunner(model, config, training, config.placement.strategy,
                                 devices)
    if example is not None:
        runner.compile_captured(*example)
    return runner


def _single_ipu_pipeline(part: Partition) -> bool:
    """A ``PipelinedExecution`` whose stages all sit on one IPU: not pipelined (as
    upstream), so it runs as a plain model on that IPU."""
    return kind_of(part.strategy) == PIPELINED and part.num_ipus == 1


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


class ModelParallelRunner:
    """StepRunner for the execution strategies (module docstring)."""

    def __init__(self, model: torch.nn.Module, config: RuntimeConfig, training: bool,
                 strategy: ExecutionStrategy,
                 devices: Optional[List[torch.device]] = None) -> None:
        self.model = model
        self.config = config
        self.training = training
        self.strategy = strategy
        self.partition: Optional[Partition] = None
        self.devices: Any = devices  # acquired with the partition when not given
        self.streaming: Optional[StreamingMemory] = None
        self.last_schedule: Optional[ScheduleRecord] = None
        self._plain = False
        self.engine: Optional[Engine] = None
        self.captured: Optional[CapturedModel] = None
        self._capture_tried = False
        self._lanes_cache: dict = {}
        # Thread-local contexts of the program (set by the device loop), entered in
        # every worker thread.
        self.worker_contexts: list = []
        first = devices[0] if devices else _ipu_device(0, config.placement)
        self.input_device = first
        self.output_device = first

    # ------------------------------------------------------------------ compile
    def compile_captured(self, args: tuple, kwargs: dict) -> Optional[Partition]:
        """Capture the model's graph and split it into stage modules run by the engine
        (pipelined and sharded execution); None when the model cannot be captured or
        its strategy is phased (the tracing runner then takes over on the first call)."""
        self._capture_tried = True
        captured = capture(self.model, args, kwargs, self.strategy)
        if captured is None:
            return None
        part = resolve_partition(captured.trace, self.strategy, self.config,
                                 self.training, 0)
        staged = None
        plain = not is_phased(self.strategy) and (not part.has_blocks
                                                  or _single_ipu_pipeline(part))
        if is_phased(self.strategy) and part.num_stages != part.num_phases:
            return None  # phases of several stages: the tracing runner
        if not plain:
            try:
                staged = split_stages(captured, part)
            except ValueError as exc:  # a sharded stage revisited: the tracing runner
                logger.info("Model parallelism: %s is run by the tracing runner (%s)",
                            type(self.model).__name__, exc)
                return None
        self._set_partition(part)
        if staged is not None:
            self.captured = captured
            self.engine = Engine(staged, [st.ipu for st in part.stages], self.devices)
        return part

    def compile(self, microbatch: tuple) -> Partition:
        """Trace the model on ``microbatch`` and set up the partition (first call)."""
        args, kwargs = microbatch
        if not self._capture_tried:
            part = self.compile_captured(args, kwargs)
            if part is not None:
                return part
        trace = trace_blocks(self.model, args, kwargs, self.strategy)
        part = resolve_partition(trace, self.strategy, self.config, self.training, 0)
        self._set_partition(part)
        return part

    def _set_partition(self, part: Partition) -> None:
        """Adopt ``part``: acquire the devices and place the weights on them."""
        self.partition = part
        if not is_phased(self.strategy) and (not part.has_blocks or _single_ipu_pipeline(part)):
            self._plain = True
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
        self.output_device = self.devices[part.stages[-1].ipu]

    def _place_weights(self, part: Partition) -> None:
        with torch.no_grad():
            for t in list(self.model.parameters()) + list(self.model.buffers()):
                stage = part.weight_stage.get(id(t))
                if stage is not None:
                    device = self.devices[part.stages[stage].ipu]
                    if t.device != device:
                        t.data = t.data.to(device)

    # ------------------------------------------------------------------ run
    def __call__(self, microbatches: List[tuple], loss_of: Optional[LossOf]) -> List[Any]:
        if self.partition is None:
            self.compile(microbatches[0])
        if self._plain:
            # no stage to place: the default runner's sequence on the one device
            return SequentialRunner(self.model)(microbatches, loss_of)
        if self.engine is not None:
            captured = self.captured
            assert captured is not None  # (set together with the engine)
            if self._engine_call(microbatches):
                inputs = [captured.inputs_of(args, kwargs) for args, kwargs in microbatches]
                ready = [i for i in inputs if i is not None]
                if len(ready) == len(inputs):
                    return self._run_engine(ready, loss_of)
            if captured.checkpoints:  # the tracing runner records whole forwards
                recompute.hook_model(self.model)
        if is_phased(self.strategy):
            return self._run_phased(microbatches, loss_of)
        if kind_of(self.strategy) == SHARDED:
            return self._run_sharded(microbatches, loss_of)
        return self._run_pipelined(microbatches, loss_of)

    def _engine_call(self, microbatches: List[tuple]) -> bool:
        """Whether the engine runs this call. The stage modules never call the model's
        ``forward``, so a call for which the executor wrapped ``model.forward`` (the
        first call's check of the overlap markers) runs through the tracing runner,
        which does; so does a call with no micro-batch."""
        return bool(microbatches) and "forward" not in self.model.__dict__

    def _run_engine(self, inputs: List[dict], loss_of: Optional[LossOf]) -> List[Any]:
        part, engine = self.partition, self.engine
        assert part is not None and engine is not None  # (compiled before any run)
        engine.worker_contexts = self.worker_contexts
        n, count, training = part.num_stages, len(inputs), loss_of is not None
        record = ScheduleRecord(n)
        if is_phased(self.strategy):
            outputs = self._run_engine_phased(inputs, loss_of, record)
        elif kind_of(self.strategy) == SHARDED or not is_pipelined(part):
            outputs = engine.run_in_order(sharded_actions(n, count, training), inputs,
                                          loss_of, record)
        else:
            key = (count, training, schedule_name(self.strategy))
            lanes = self._lanes_cache.get(key)
            if lanes is None:
                per_stage = stage_schedules(key[2], n, count, training)
                if training:
                    per_stage = defer_weight_halves(per_stage, engine.producers)
                lanes = device_lanes(per_stage, engine.stage_device, len(self.devices),
                                     engine.producers, engine.consumers)
                self._lanes_cache[key] = lanes
            outputs = engine.run_lanes(lanes, inputs, loss_of, record)
        self._keep(record)
        return outputs

    def _run_engine_phased(self, inputs: List[dict], loss_of: Optional[LossOf],
                           record: ScheduleRecord) -> List[Any]:
        """Phases (one stage each) on the engine: serial phases in this thread, parallel
        phases on the even / odd devices' workers; a phase's weights are streamed in
        before its first action and out when its lane moves on."""
        part, engine, streaming = self.partition, self.engine, self.streaming
        assert part is not None and engine is not None and streaming is not None
        count, training = len(inputs), loss_of is not None
        lane_phase: dict = {}
        lock = threading.Lock()

        def before(lane: int, op: tuple) -> None:
            phase = part.stages[op[1]].phase
            with lock:
                streaming.enter(phase, lane_phase.get(lane))
                lane_phase[lane] = phase

        scope = lambda: streaming.activation_scope(self.devices)  # noqa: E731
        try:
            if kind_of(self.strategy) == PARALLEL_PHASED:
                lanes: List[list] = [[] for _ in self.devices]
                for ops in parallel_phased_schedule(part.num_phases, count, training):
                    for op in ops:
                        lanes[engine.stage_device[op[1]]].append(op)
                return engine.run_lanes(lanes, inputs, loss_of, record, before, (scope, ))
            ops = sequential_schedule(list(range(part.num_stages)), count, training)[0]
            with scope():
                return engine.run_in_order(ops, inputs, loss_of, record, cut=True,
                                           before=before)
        finally:
            streaming.offload_all()

    def _run_sharded(self, microbatches, loss_of):
        part = self.partition
        record = ScheduleRecord(part.num_stages)
        outputs = []
        for m, (args, kwargs) in enumerate(microbatches):
            run = StageRun(part, self.devices, m, list(range(part.num_stages)), None, cut=False)
            with listening(run), run:
                run.start()
                out = self.model(*args, **kwargs)
                loss = loss_of(out) if loss_of is not None else None
            for stage in _dedupe(run.stage_trail):
                record.events.append(ScheduleEvent(0, FORWARD, stage, m, 0.0))
            if loss is not None:
                loss.backward()
                for stage in reversed(_dedupe(run.stage_trail)):
                    record.events.append(ScheduleEvent(0, BACKWARD, stage, m, 0.0))
            outputs.append(out)
        self._keep(record)
        return outputs

    def _run_pipelined(self, microbatches, loss_of):
        part = self.partition
        n, count = part.num_stages, len(microbatches)
        training = loss_of is not None
        lanes = stage_schedules(schedule_name(self.strategy), n, count, training)
        gate = LaneScheduler(lanes, n)
        units = list(range(n))
        outputs = self._run_threads(microbatches, loss_of, gate, units)
        self._keep(gate.record)
        return outputs

    def _run_phased(self, microbatches, loss_of):
        part = self.partition
        count, training = len(microbatches), loss_of is not None
        phases = part.num_phases
        if kind_of(self.strategy) == PARALLEL_PHASED:
            lanes = parallel_phased_schedule(phases, count, training)
        else:
            lanes = sequential_schedule(list(range(phases)), count, training)
        streaming = self.streaming
        lane_phase: dict = {}
        lane_of = {op: i for i, ops in enumerate(lanes) for op in ops}
        lock = threading.Lock()

        def on_start(op):
            lane = lane_of[op]
            with lock:
                streaming.enter(op[1], lane_phase.get(lane))
                lane_phase[lane] = op[1]

        gate = LaneScheduler(lanes, phases, on_start=on_start)
        units = [s.phase for s in part.stages]
        try:
            outputs = self._run_threads(microbatches, loss_of, gate, units)
        finally:
            streaming.offload_all()
        self._keep(gate.record)
        return outputs

    def _run_threads(self, microbatches, loss_of, gate, units):
        part, devices, model = self.partition, self.devices, self.model
        grad_enabled = torch.is_grad_enabled()
        streaming = self.streaming

        def work(m: int):
            args, kwargs = microbatches[m]
            run = StageRun(part, devices, m, units, gate, cut=True)
            scope = streaming.activation_scope(devices) if streaming else nullcontext()
            with torch.set_grad_enabled(grad_enabled), context.running_on_ipu(), scope, \
                    context.worker_scope(self.worker_contexts):
                with listening(run), run:
                    run.start()
                    out = model(*args, **kwargs)
                    run.finish_forward()
                    if loss_of is not None:
                        run.loss = loss_of(out)
                    run.release_forward()
                if loss_of is not None:
                    for unit in reversed(range(run.num_units)):
                        gate.acquire(BACKWARD, unit, m)
                        run.backward_unit(unit)
                        gate.release(BACKWARD, unit, m)
            return out

        return run_workers(len(microbatches), work, gate)

    def _keep(self, record: ScheduleRecord) -> None:
        """Publish the schedule just run, on the runner and on the strategy object the
        user made (the options hold a copy of it; see ``strategies._origin``)."""
        self.last_schedule = record
        publish_schedule(self.strategy, record)


def _dedupe(trail: List[int]) -> List[int]:
    out: List[int] = []
    for s in trail:
        if not out or out[-1] != s:
            out.append(s)
    return out


def _ipu_device(ipu: int, placement: PlacementConfig) -> torch.device:
    from ... import _devices  # pylint: disable=import-outside-toplevel
    return _devices.ipu_device(ipu, placement.device_options)
