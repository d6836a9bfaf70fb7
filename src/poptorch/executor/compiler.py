"""The compile of a PopTorch model: from the model, its options and example inputs to
one :py:class:`~poptorch._runtime.compilation.Compilation`.

``PoplarExecutor._compile`` calls :py:func:`compile_model` with the executor's
user-facing state (the models, options, training flag, optimizer, replica groupings,
a precompiled file's contents) and holds what it returns; nothing here keeps a
reference to the executor. A compile that fails leaves nothing behind on the model's
modules.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, cast

import torch

from .. import _devices
from .._runtime.batching.anchors import AnchorRecorder
from .._runtime.batching.plan import BatchPlan, resolve_output_mode, split_inputs
from .._runtime.batching.signature import InputSignature
from .._runtime.compilation import Compilation
from .._runtime.config import RuntimeConfig
from .._runtime.context import ContextFactory
from .._runtime.distributed.replicas import DataParallelGroup
from .._runtime.distributed.stage_processes import StageReplicaGroup
from .._runtime.executable.decisions import DecisionStore, decisions_folder
from .._runtime.memory.host_heap import keep_freed_memory
from .._runtime.placement.build import ModelParallelRunner, build_runner
from .._runtime.program.backend_choice import make_selector
from .._runtime.program.backends import EagerBackend
from .._runtime.program.compiled_step import torch_compile_backend
from .._runtime.program.concurrent_replicas import ReplicaCopies
from .._runtime.program.device_loop import DeviceProgram
from .._runtime.program.interpreter import EagerCompute, Interpreter
from .._runtime.program.optimizer import (
    DeviceOptimizerSync,
    OptimizerBinding,
    attach_optimizer,
    make_loss_scaler,
)
from .._runtime.program.overlapped_io import FirstForwardCheck
from .._runtime.program.replica_groups import GroupedParameter
from .._runtime.program.rng import RngScope
from .._runtime.program.runner import StepRunner
from .._runtime.program.spec import ProgramSpec
from .._runtime.schedule.timeline import ScheduleRecord
from .._runtime.weights.constants import TensorConstants
from .._runtime.weights.sync import WeightSync
from ..enums import CommGroupType
from ..errors import Error
from . import optimizer_rules, program_setup
from .call_support import backend_name, to_cpu
from .local_replicas import concurrent_replicas, replica_lanes
from .processes import join_processes

if TYPE_CHECKING:  # (imported where stages run on processes: torch's pipelining)
    from .._runtime.placement.processes import StageProcessRunner
    from ..optim.base import Optimizer as PoptorchOptimizer
    from ..options.options import Options


class Progress(Protocol):
    """The compile's progress bar (a ``tqdm``): one ``update()`` per stage."""

    def update(self) -> object: ...


@dataclass(frozen=True)
class ModelParts:
    """The executor's user-facing state a compile reads."""
    model: torch.nn.Module  # the executor's shallow copy (the device model)
    user_model: torch.nn.Module
    options: Options  # the executor's own
    training: bool
    optimizer: torch.optim.Optimizer | None  # the user's optimizer (training) or None
    version: str
    groupings: dict  # replicaGrouping of parameters, by name
    name: str  # "<model>.training" / "<model>.inference", for messages


def batch_plan(config: RuntimeConfig) -> BatchPlan:
    """How a call's inputs split into device iterations and micro-batches."""
    return BatchPlan(config.device_iterations, config.training.gradient_accumulation,
                     config.replication_factor, config.distributed.input_group_size,
                     CommGroupType(config.distributed.input_cgt))


def optimizer_sync(user_optimizer: torch.optim.Optimizer,
                   device_optimizer: torch.optim.Optimizer
                   ) -> DeviceOptimizerSync | None:
    """The sync of a user's optimizer with its device copy, None when not needed."""
    if DeviceOptimizerSync.needed(user_optimizer, device_optimizer):
        # (``needed``: both are poptorch.optim optimizers)
        return DeviceOptimizerSync(cast("PoptorchOptimizer", user_optimizer),
                                   cast("PoptorchOptimizer", device_optimizer))
    return None


def compile_model(parts: ModelParts, args: tuple, kwargs: dict,
                  precompiled: dict | None, progress: Progress) -> Compilation:
    """Compile ``parts`` for inputs like ``(args, kwargs)`` (docs/design.md, the data
    flow of a call); ``progress.update()`` marks each of four stages."""
    opts, model, training = parts.options, parts.model, parts.training
    if training:  # (adjusts the options; never raises before a model is compiled)
        optimizer_rules.apply_mean_reduction_rule(opts, parts.optimizer, False)
    config = RuntimeConfig.of(opts)  # what the compile and the engine read from here on
    plan = batch_plan(config)
    split_inputs(plan, args, kwargs)  # check batch sizes before anything else
    program_setup.check_precompiled_inputs(precompiled, args, kwargs)
    signature = InputSignature(model.forward, args, kwargs)
    tensor_constants = TensorConstants(model)
    buffers = list(model.buffers())
    progress.update()
    runners = _build_runners(parts, config, plan, (args, kwargs))
    device = runners.input_device
    backend = backend_name(opts, device)
    if device.type == "cpu":  # the heap is this IPU's memory: kept between steps
        keep_freed_memory()
    progress.update()
    weights, binding = _weights_and_optimizer(parts, config, device)
    # Only training needs the other processes; an inference model runs on its own
    # (a program may evaluate on process 0 alone).
    cross = join_processes(config, model, training,
                           None if binding is None else binding.device, parts.name,
                           device, runners.stage_processes) if training else None
    if backend == "inductor" and isinstance(cross, DataParallelGroup) and \
            cross.sharded is not None:  # (the eager call path runs compiled blocks)
        cross.sharded.compile_units(torch_compile_backend(), parts.name)
    processes = 1 if cross is None else cross.world.size
    first_replica = 0 if cross is None else cross.world.rank * plan.replication_factor
    replica_buffers = runners.concurrent or replica_lanes(
        model, config, parts.groupings, runners.plain, plan, first_replica, processes)
    if binding is not None and runners.plain is not None:
        optimizer_rules.mark_grouped(parts.optimizer, (parts.model, parts.user_model), {
            state.name: state.group_count for state in runners.plain.states
            if isinstance(state, GroupedParameter)})
    if cross is not None:
        # (replica-grouped weights change shape per replica: DDP cannot reduce them;
        # groupings of CommGroupType.All are plain weights and make no lane state)
        grouped = runners.plain is not None and any(
            isinstance(state, GroupedParameter) for state in runners.plain.states)
        cross.attach_sync(None if runners.concurrent else runners.plain, runners.compute,
                          grouped, device)
    progress.update()
    if binding is not None:  # what setOptimizer checks later optimizers against
        from ..optim.attributes import snapshot_constants
        assert parts.optimizer is not None  # (a training model's)
        binding.constants = snapshot_constants(parts.optimizer)
    extras = program_setup.program_extras(
        plan, model=model, user_model=parts.user_model, config=config,
        training=training, device=device,
        optimizer=(lambda: None) if binding is None else (lambda: binding.device),
        cross=cross, groupings=parts.groupings, name=parts.name,
        popart_options=opts._Popart.options, executed=runners.executed,
        unsplit=runners.plain is not None and runners.concurrent is None)
    runners.share_thread_contexts(extras.worker_contexts)
    if runners.plain is not None:
        runners.plain.observer = extras.trace
    try:
        program, anchors = _build_program(parts, config, plan, extras, device, binding,
                                          cross, runners, backend, precompiled,
                                          (args, kwargs))
        source = program_setup.program_source(
            backend, args, kwargs, precompiled, opts,
            {"training": training, "model": model, "optimizer": parts.optimizer,
             "version": parts.version})
        synthetic = None
        if config.synthetic_mode:
            from .._runtime.batching.synthetic import SyntheticInputs
            synthetic = SyntheticInputs(device, config.synthetic_mode)
    except BaseException:
        for handle in extras.hooks:
            handle.remove()
        raise
    progress.update()
    return Compilation(
        config=config, device=device, backend=backend, program=program,
        weights=weights, signature=signature, tensor_constants=tensor_constants,
        buffers=buffers, source=source, precision=extras.precision,
        casting=extras.casting, optimizer=binding, replica_buffers=replica_buffers,
        synthetic=synthetic, anchors=anchors, autocast_hooks=extras.hooks,
        gather_weights=None if runners.stage_processes is None
        else runners.stage_processes.gather_weights)


@dataclass
class StepRunners:
    """What runs a program's steps, by type (nothing is found again by probing): the
    one-stage interpreter over the model (``plain``, with its eager ``compute``), its
    replicas' concurrent lanes on several devices, or model parallelism (the
    in-process engine, ``placed``, or ``stage_processes``)."""
    input_device: torch.device
    plain: Interpreter | None = None
    compute: EagerCompute | None = None
    concurrent: ReplicaCopies | None = None
    placed: ModelParallelRunner | None = None
    stage_processes: StageProcessRunner | None = None

    @property
    def runner(self) -> StepRunner:
        """The runner of the eager backend."""
        runner = self.stage_processes or self.placed or self.plain
        assert runner is not None  # (one of them is always built)
        return runner

    @property
    def replaceable(self) -> bool:
        """Whether the compiled backend may run the steps instead (``ProgramSpec.plain``):
        the one-stage interpreter with nothing per replica (the processes' reduction
        is the compiled backend's own)."""
        return self.plain is not None and self.concurrent is None and not self.plain.states

    def executed(self) -> ScheduleRecord | None:
        """The schedule the last model-parallel step executed (profiling), or None."""
        parallel = self.stage_processes or self.placed
        return None if parallel is None else parallel.last_schedule

    def share_thread_contexts(self, factories: list[ContextFactory]) -> None:
        """Give the runners with worker threads the thread-local part of the program's
        wrappers (torch function modes), entered in every worker."""
        if self.placed is not None:
            self.placed.worker_contexts = factories
        if self.concurrent is not None:
            self.concurrent.worker_contexts = factories


def _build_runners(parts: ModelParts, config: RuntimeConfig, plan: BatchPlan,
                   example: tuple) -> StepRunners:
    """The step runners of the options (module docstring of ``StepRunners``)."""
    # PopTorch's rules of the overlap markers: checked on the captured graph, or on the
    # first forward of a model that is not captured
    overlap = program_setup.overlap_settings(
        parts.options, resolve_output_mode(config.output_mode, parts.training))
    model = parts.model
    if config.distributed.stages_on_processes:  # one process per stage (torchrun)
        from .._runtime.placement.processes import StageProcessRunner
        staged = StageProcessRunner(model, config, parts.training, example, overlap)
        return StepRunners(staged.input_device, stage_processes=staged)
    placed = build_runner(model, config, parts.training, example=example, overlap=overlap)
    if placed is not None:
        return StepRunners(placed.input_device, placed=placed)
    device = _devices.acquire_devices(parts.options, 1)[0]
    check = FirstForwardCheck(overlap)
    compute = EagerCompute(model, check)
    plain = Interpreter(compute, buffers=tuple(model.buffers()), per_step=plan.per_step,
                        replicas=plan.replication_factor)
    concurrent = concurrent_replicas(model, parts.options, config, parts.groupings,
                                     plain, plan)
    return StepRunners(device, plain=plain, compute=compute, concurrent=concurrent)


def _weights_and_optimizer(parts: ModelParts, config: RuntimeConfig, device: torch.device
                           ) -> tuple[WeightSync, OptimizerBinding | None]:
    model, options = parts.model, parts.options
    updatable = options.updatable_named_buffers
    if updatable is not None:
        known = [n for n, _ in model.named_buffers()]
        unknown = [n for n in updatable if n not in known]
        if unknown:
            raise Error(f"updatableNamedBuffers: the model has no buffer named "
                        f"{', '.join(map(repr, unknown))}; its buffers are: "
                        f"{', '.join(known) or '(none)'}.")
    sync = WeightSync(parts.user_model, model, device)
    if not parts.training:
        return sync, None
    optimizer = parts.optimizer
    assert optimizer is not None  # (a training model's)
    attached = attach_optimizer(optimizer, model, parts.user_model, sync)
    optimizer_rules.mark_compiled(optimizer, options)
    keys = optimizer_rules.attribute_keys(optimizer)
    # (its constant attributes are recorded once the program is built)
    return sync, OptimizerBinding(attached, optimizer_sync(optimizer, attached), keys,
                                  make_loss_scaler(optimizer, config))


def _build_program(parts: ModelParts, config: RuntimeConfig, plan: BatchPlan,
                   extras: program_setup.ProgramExtras, device: torch.device,
                   binding: OptimizerBinding | None,
                   cross: DataParallelGroup | StageReplicaGroup | None, runners: StepRunners,
                   backend: str, precompiled: dict | None, example: tuple
                   ) -> tuple[DeviceProgram, AnchorRecorder | None]:
    """The device program of one call, and its anchored tensors' recorder (or None)."""
    model, training = parts.model, parts.training
    params = [p for p in model.parameters() if p.requires_grad]
    buffers = list(model.buffers())
    anchors = None
    if config.anchored_tensors:
        anchors = AnchorRecorder(model, config, plan, training)
    eager = EagerBackend(runners.runner, binding, extras.managed_step)
    selector = make_selector(
        backend=backend, plain=runners.replaceable, eager=eager, model=model, training=training,
        device=device, label=parts.name, binding=binding,
        managed_step=extras.managed_step is not None, wraps_calls=extras.wraps_calls,
        params=params, buffers=buffers, cross=cross,
        decisions=_decisions(parts, backend, *example),
        decided=None if precompiled is None else precompiled.get("backend_decision"),
        progress=bool(parts.options.show_compilation_progress_bar))
    spec = ProgramSpec(
        label=parts.name, plan=plan, runner=runners.runner, plain=runners.replaceable,
        training=training,
        output_mode=resolve_output_mode(config.output_mode, training),
        output_return_period=config.output_return_period, params=tuple(params),
        buffers=tuple(buffers), training_config=config.training,
        rng=RngScope(config.random_seed, device), device=device,
        to_host=None if device.type == "cpu" else to_cpu, anchors=anchors, cross=cross,
        wrappers=extras.wrappers, finite_check=extras.finite_check,
        named_params=extras.named_params, call_profiler=extras.call_profiler,
        trace=extras.trace, synthetic=bool(config.synthetic_mode))
    return DeviceProgram(spec, selector, binding), anchors


def _decisions(parts: ModelParts, backend: str, args: tuple, kwargs: dict
               ) -> DecisionStore | None:
    """Where the trial's choice of this program is kept (``executable/decisions.py``)."""
    if backend != "fastest":
        return None
    options = parts.options
    folder = decisions_folder(options.executable_cache_dir)
    if folder is None:
        return None
    from .._runtime.executable.cache import cache_key
    from .._runtime.executable.signature import InputSignature as ExportedSignature
    key = cache_key(backend=backend, training=parts.training, options=options.toDict(),
                    model=parts.model, optimizer=parts.optimizer,
                    signature=ExportedSignature.of(args, kwargs), version=parts.version)
    return DecisionStore(folder, key)
