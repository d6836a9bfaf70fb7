"""A pipelined model whose stages run in separate processes (``torchrun``).

With ``Options.Distributed.stagesOnProcesses()`` the model is captured and split into
stage modules as for the in-process engine; process ``p`` keeps stage ``p % stages`` of
pipeline replica ``p // stages`` (:mod:`..distributed.stage_processes`) and runs it
with ``torch.distributed.pipelining`` (a ``PipelineStage`` and ``ScheduleGPipe`` /
``Schedule1F1B``); activations and gradients travel between neighbouring processes.

torch only links neighbouring stages, so each stage module is wrapped
(:class:`_StageAdapter`) to pass on the values a later stage reads from an earlier one.
Model inputs are not sent: every process of a pipeline is called with the same batch
and each stage reads the inputs it needs as keyword arguments. The last stage rebuilds
the model's output, computes PopTorch's loss and broadcasts the outputs to the other
processes of its pipeline, so every process returns what PopTorch returns.
"""
from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from ..._typing import UserInput, UserOutput
from ...enums import OutputMode
from ...errors import Error
from .. import context
from ..config import RuntimeConfig
from ..distributed import stage_processes
from ..distributed import world as world_module
from ..distributed.collectives import failures_as_errors
from ..distributed.consistency import check_same_everywhere
from ..distributed.output_broadcast import OutputBroadcast
from ..program.overlapped_io import OverlapSettings
from ..program.runner import LossOf
from ..schedule import schedules
from ..schedule.timeline import PROCESSES, ScheduleEvent, ScheduleRecord
from ..torch_internals import pytree
from . import recompute
from .capture import CapturedModel, check_markers, trace_model
from .partition import resolve_partition
from .stages import StagedModel, StageModule, split_stages
from .strategy import (
    PIPELINED,
    ExecutionStrategy,
    publish_schedule,
    schedule_name,
)

if TYPE_CHECKING:
    from torch.distributed.pipelining import PipelineStage


class _StageAdapter(torch.nn.Module):
    """One stage as ``torch.distributed.pipelining`` runs it: positional inputs are the
    values carried from the previous stage, keyword inputs the model inputs it reads;
    the outputs are the values the next stage needs (the last stage: the tensors of the
    model's output and of its marked losses)."""

    def __init__(self, stage: StageModule, in_plan: list, out_plan: list,
                 recording: bool, last: bool) -> None:
        super().__init__()
        self.stage = stage.module
        self.index = stage.index
        self.in_plan = in_plan  # per stage-module input: ("carry", i) or ("input", name)
        self.out_plan = out_plan  # per output: ("own", pos), ("carry", i), ("arg", i)
        self.recording = recording  # recomputation checkpoints in this stage
        self.last = last

    def forward(self, *carried: torch.Tensor, **inputs: UserInput) -> tuple:
        # the schedule's ``step()`` hands each micro-batch's inputs with a leading unit
        # dimension (its chunk of the stacked step, see ``StageProcessRunner.__call__``)
        inputs = pytree.tree_map_only(torch.Tensor, lambda t: t.squeeze(0), inputs)
        args = [carried[x] if kind == "carry" else inputs[x] for kind, x in self.in_plan]
        if self.recording and torch.is_grad_enabled():
            with recompute.recording(self.stage):
                out = self.stage(*args)
        else:
            out = self.stage(*args)
        result = []
        for kind, x in self.out_plan:
            if kind == "own":
                value = out[x]
            else:
                value = carried[x] if kind == "carry" else args[x]
                if isinstance(value, torch.Tensor) and value.requires_grad:
                    value = value.view_as(value)  # passed on: a new autograd node
            if not isinstance(value, torch.Tensor):
                raise Error(
                    f"Distributed.stagesOnProcesses: stage {self.index} hands "
                    f"{type(value).__name__} {value!r} to a later stage or to the "
                    "model's output; only tensors travel between processes. Move the "
                    "block boundary so that a stage passes on tensors only, or compute "
                    "the value in the stage that uses it.")
            result.append(value)
        if self.last:  # a leading unit dimension: torch concatenates the chunks on it
            return tuple(value.unsqueeze(0) for value in result)
        return tuple(result)


def _plan_adapters(staged: StagedModel) -> list[_StageAdapter]:
    """The adapters of every stage (module docstring): which values cross each
    boundary, and where each stage finds its inputs and its outputs."""
    stages = staged.stages
    n = len(stages)
    carry: list[list] = []  # carry[k]: values (producer, position) crossing k -> k + 1
    for k in range(n - 1):
        values: list = []
        for later in stages[k + 1:]:
            for src in later.sources:
                if src[0] == "stage" and src[1] <= k and (src[1], src[2]) not in values:
                    values.append((src[1], src[2]))
        carry.append(values)
    adapters = []
    for k, stage in enumerate(stages):
        incoming = carry[k - 1] if k else []
        in_plan = [("input", src[1]) if src[0] == "input"
                   else ("carry", incoming.index((src[1], src[2]))) for src in stage.sources]
        if k < n - 1:
            out_plan = [("own", pos) if p == k else ("carry", incoming.index((p, pos)))
                        for p, pos in carry[k]]
        else:
            out_plan = []
            for src in staged.output_sources + staged.loss_sources:
                if src[0] == "import":
                    out_plan.append(("arg", src[1]))
                elif src[0] == "stage":
                    out_plan.append(("own", src[2]))
        adapters.append(_StageAdapter(stage, in_plan, out_plan, stage.checkpoints,
                                      last=k == n - 1))
    return adapters


class StageProcessRunner:
    """The step runner of a model whose stages run on processes (module docstring)."""

    def __init__(self, model: torch.nn.Module, config: RuntimeConfig, training: bool,
                 example: tuple | None, overlap: OverlapSettings | None = None) -> None:
        strategy = config.placement.strategy
        if strategy.schedule_kind != PIPELINED:
            raise Error(
                f"Distributed.stagesOnProcesses needs a pipelined model, but the execution "
                f"strategy is {type(strategy).__name__}: use poptorch.PipelinedExecution "
                "(opts.setExecutionStrategy(poptorch.PipelinedExecution(...))), or leave "
                "stagesOnProcesses off.")
        if config.replication_factor != 1:
            raise Error(
                f"Distributed.stagesOnProcesses with replicationFactor("
                f"{config.replication_factor}): a process runs one stage of one replica. "
                "Replicate the pipeline with more processes instead (processes = stages x "
                "replicas) and keep replicationFactor(1).")
        if training and config.training.automatic_loss_scaling:
            raise Error(
                "Distributed.stagesOnProcesses with Training.setAutomaticLossScaling(True): "
                "each process would decide on its own stage's gradients whether to skip a "
                "step, and the stages would drift apart. Use a fixed loss scale "
                "(the optimizer's loss_scaling) or leave stagesOnProcesses off.")
        if schedule_name(strategy) not in ("1F1B", "GPipe"):
            raise Error(
                f"Distributed.stagesOnProcesses with the {schedule_name(strategy)} schedule: "
                "with one stage per process only GPipe and 1F1B run (interleaved and "
                "zero-bubble schedules need several stages per device). Use "
                "setSchedule('1F1B') or setSchedule('GPipe'), or run the pipeline in one "
                "process (leave stagesOnProcesses off).")
        if example is None:
            raise Error("Distributed.stagesOnProcesses: the model must be compiled with "
                        "example inputs (call it, or compile(*inputs)).")
        from ... import _devices  # pylint: disable=import-outside-toplevel
        self.model = model
        self.config = config
        self.training = training
        self.strategy = strategy
        self.device = _devices.acquire_devices(config.placement.device_options, 1)[0]
        self.input_device = self.device
        self.last_schedule: ScheduleRecord | None = None
        captured = _capture_or_explain(model, example, strategy, overlap)
        part = resolve_partition(captured.trace, strategy, config, training)
        world = world_module.join(config.distributed.process_id,
                                  config.distributed.num_processes, self.device)
        stage_processes.check_world(world, part.num_stages)
        try:
            staged = split_stages(captured, part)
        except ValueError as exc:
            raise Error(f"Distributed.stagesOnProcesses: the model cannot be split into "
                        f"pipeline stages ({exc}).") from None
        check_same_everywhere(world, {
            "pipeline stages": part.num_stages, "training": training,
            "Training.gradientAccumulation": config.training.gradient_accumulation,
            "deviceIterations": config.device_iterations,
            "schedule": schedule_name(strategy)})
        self.layout = stage_processes.make_layout(world, part.num_stages)
        self.captured: CapturedModel = captured
        self.staged = staged
        adapters = _plan_adapters(staged)
        self.adapter = adapters[self.layout.stage]
        self._needs = [sorted({x for kind, x in a.in_plan if kind == "input"})
                       for a in adapters]
        self._schedules: dict = {}
        self._inputs_checked = False
        self._final_only = config.output_mode == OutputMode.Final.value
        self._broadcast = OutputBroadcast(self.layout.last_rank, self.layout.pipeline_group,
                                          self.device)
        self._loss_of: LossOf | None = None
        # every process starts from process 0's weights; this stage's go to its device
        tensors = list(model.parameters()) + list(model.buffers())
        stage_processes.start_from_process_0(world, tensors)
        self._stage_tensors = [[t for t in tensors if part.weight_stage.get(id(t)) == s]
                               for s in range(part.num_stages)]
        with torch.no_grad():
            for t in self._stage_tensors[self.layout.stage]:
                if t.device != self.device:
                    t.data = t.data.to(self.device)

    # ------------------------------------------------------------------ processes
    def cross_processes(self, broadcast_buffers: bool
                        ) -> stage_processes.StageReplicaGroup | None:
        """The cross-process side of a training program: this stage's gradients summed
        over its replicas (None with one replica: nothing to reduce)."""
        if self.layout.replicas == 1:
            return None
        mine = self._stage_tensors[self.layout.stage]
        params = [t for t in mine if isinstance(t, torch.nn.Parameter) and t.requires_grad]
        buffers = [t for t in mine if not isinstance(t, torch.nn.Parameter)]
        return stage_processes.StageReplicaGroup(self.layout, params, buffers,
                                             broadcast_buffers)

    def gather_weights(self) -> None:
        """Give every process every stage's weights and buffers (from replica 0): a
        collective, called by ``copyWeightsToHost`` on every process."""
        stage_processes.gather_stages(self.layout, self._stage_tensors)

    # ------------------------------------------------------------------ run
    def __call__(self, microbatches: list[tuple], loss_of: LossOf | None
                 ) -> list[UserOutput]:
        inputs = []
        for args, kwargs in microbatches:
            values = self.captured.inputs_of(args, kwargs)
            if values is None:
                raise Error("Distributed.stagesOnProcesses: a non-tensor argument of the "
                            "model differs from the one it was compiled with; compile a "
                            "new model for it.")
            inputs.append(values)
        if not self._inputs_checked:
            self._check_same_inputs(inputs)
        training = loss_of is not None
        schedule, stage = self._schedule(len(inputs), training)
        s = self.layout.stage
        # torch's public step() splits a whole batch on dimension 0: the micro-batches'
        # inputs are stacked on a new one (the adapter takes it off again)
        kwarg_mbs = [{name: values[name] for name in self._needs[s]} for values in inputs]
        stacked = pytree.tree_map(
            lambda *leaves: (torch.stack(leaves).to(self.device)
                             if isinstance(leaves[0], torch.Tensor) else leaves[0]),
            *kwarg_mbs)
        # torch's last stage wants a target per micro-batch: the loss needs none
        target = torch.zeros(len(inputs)) if training else None
        self._loss_of = loss_of
        try:
            with failures_as_errors("Running the pipeline stages", runs_model=True):
                try:
                    schedule.step(target=target, **stacked)
                except RuntimeError as exc:  # torch wraps the stage's errors: ours back
                    if isinstance(exc.__cause__, Error):
                        raise exc.__cause__ from None
                    raise
                outputs = self._outputs(stage, inputs)
        finally:
            self._loss_of = None
        self._keep(len(inputs), training)
        return outputs

    def _schedule(self, count: int, training: bool) -> tuple:
        """The stage and schedule for ``count`` micro-batches (made at the first such
        call: torch's schedule infers the shapes crossing the stages then)."""
        key = (count, training)
        made = self._schedules.get(key)
        if made is None:
            from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe  # pylint: disable=import-outside-toplevel
            layout = self.layout
            stage = PipelineStage(self.adapter, layout.stage, layout.stages, self.device,
                                  group=layout.pipeline_group)
            one_f_one_b = training and schedule_name(self.strategy) == "1F1B"
            cls = Schedule1F1B if one_f_one_b else ScheduleGPipe
            schedule = cls(stage, n_microbatches=count,
                           loss_fn=self._loss if training else None, scale_grads=False)
            made = self._schedules[key] = (schedule, stage)
        return made

    def _rebuild(self, values: torch.Tensor | tuple[torch.Tensor, ...]) -> tuple:
        """The model's output and its marked losses from the last stage's outputs."""
        values = (values, ) if isinstance(values, torch.Tensor) else tuple(values)
        it = iter(values)
        staged = self.staged
        leaves = [src[1] if src[0] == "const" else next(it) for src in staged.output_sources]
        losses = [src[1] if src[0] == "const" else next(it) for src in staged.loss_sources]
        return pytree.tree_unflatten(leaves, staged.output_spec), losses

    def _loss(self, output: torch.Tensor | tuple[torch.Tensor, ...], target: torch.Tensor
              ) -> torch.Tensor:
        """The last stage's loss function: PopTorch's loss of the model's output (also
        called once on copies while torch's schedule infers the shapes it sends)."""
        model_output, losses = self._rebuild(pytree.tree_map_only(
            torch.Tensor, lambda t: t[0], output))
        for loss in losses:
            context.mark_loss(loss)
        loss_of = self._loss_of
        assert loss_of is not None  # (set for the duration of a training step)
        return loss_of(model_output)

    def _outputs(self, stage: PipelineStage, inputs: list[dict]) -> list[UserOutput]:
        """Every micro-batch's output, on every process of the pipeline: the last stage
        has them and broadcasts them to the others (with ``OutputMode.Final``, only the
        last micro-batch's, the one the program returns)."""
        outputs = all_outputs = None
        if stage.is_last:
            outputs = all_outputs = [
                self._rebuild(pytree.tree_map_only(torch.Tensor, lambda t: t[0], chunk))[0]
                for chunk in stage.output_chunks]
            stage.output_chunks.clear()
        key = (len(inputs), stage.has_backward, tuple(
            (name, tuple(t.shape), t.dtype) for name in sorted(inputs[0])
            for t in pytree.tree_leaves(inputs[0][name]) if isinstance(t, torch.Tensor)))
        if self._final_only and outputs is not None:
            outputs = outputs[-1:]
        received = self._broadcast(key, outputs)
        if all_outputs is not None:  # the last stage
            return all_outputs
        # OutputMode.Final reads only the last micro-batch's output: only it travels
        return received * len(inputs) if self._final_only else received

    def _check_same_inputs(self, inputs: list[dict]) -> None:
        """The processes of a pipeline must be fed the same batch (each stage reads the
        inputs it needs from its own call): compared once, at the first call."""
        digest = hashlib.sha1()
        for values in inputs:
            for name in sorted(values):
                for leaf in pytree.tree_leaves(values[name]):
                    if isinstance(leaf, torch.Tensor):
                        digest.update(leaf.detach().cpu().contiguous().numpy().tobytes())
        layout = self.layout
        seen: list = [None] * layout.stages
        with failures_as_errors("Comparing the inputs of the pipeline's processes"):
            dist.all_gather_object(seen, digest.hexdigest(), group=layout.pipeline_group)
        if len(set(seen)) > 1:
            raise Error(
                "Distributed.stagesOnProcesses: the processes of a pipeline were called "
                "with different inputs. Every process of pipeline replica r must be given "
                "the same batch (that replica's): with poptorch.DataLoader, give it options "
                "whose Distributed.configureProcessId is (r, replicas), where r = process "
                "// stages.")
        self._inputs_checked = True

    def _keep(self, count: int, training: bool) -> None:
        """Publish the schedule the processes ran, on the runner and the user's
        strategy object (every stage's action order, as torch's schedule runs it)."""
        n = self.layout.stages
        lanes = (schedules.one_f_one_b(n, count)
                 if training and schedule_name(self.strategy) == "1F1B"
                 else schedules.gpipe(n, count, training))
        record = ScheduleRecord(n, runtime=PROCESSES)
        for s, lane in enumerate(lanes):
            record.events += [ScheduleEvent(s, op.kind, op.stage, op.microbatch, 0.0)
                              for op in lane]
        self.last_schedule = record
        publish_schedule(self.strategy, record)


def _capture_or_explain(model: torch.nn.Module, example: tuple, strategy: ExecutionStrategy,
                        overlap: OverlapSettings | None) -> CapturedModel:
    """The captured model (its overlap markers checked with the options' ``overlap``
    settings), or an error saying why it cannot be split over processes."""
    args, kwargs = example
    try:
        return check_markers(trace_model(model, args, kwargs, strategy), overlap)
    except Error:
        raise
    except Exception as exc:  # pylint: disable=broad-except
        raise Error(
            f"Distributed.stagesOnProcesses: {type(model).__name__} cannot be captured as "
            f"a graph ({type(exc).__name__}: {exc}), so it cannot be split into stage "
            "processes. The forward pass must be traceable by torch.fx: no control flow "
            "that depends on tensor values, no *args / **kwargs. Simplify forward, or "
            "leave stagesOnProcesses off to run every stage in each process.") from None
