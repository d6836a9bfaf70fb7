"""What a compiled model adds around its device program when its options or its
origin ask: precision and casting, tensor locations, profiling
(``_runtime/tracing.py``) and the source of its compiled program, a precompiled file or
the executable cache (``_runtime/executable/``). Each piece is worked out before the
program is built and handed to it in its spec; nothing is installed when unused."""
from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

from .._runtime.batching.plan import BatchPlan
from .._runtime.config import RuntimeConfig
from .._runtime.context import ContextFactory
from .._runtime.executable.signature import InputSignature
from .._runtime.executable.source import ProgramSource
from .._runtime.placement.strategy import PIPELINED
from .._runtime.program.overlapped_io import OverlapSettings
from .._runtime.schedule.timeline import ScheduleRecord
from .._runtime.tracing import CallProfiler, StepTrace, profile_directory
from .._typing import OptionsView, UserOutput
from ..enums import OutputMode

if TYPE_CHECKING:
    from .._runtime.distributed.replicas import DataParallelGroup
    from .._runtime.distributed.stage_processes import StageReplicaGroup
    from .._runtime.numerics.autocast import AutocastRun
    from .._runtime.numerics.precision import PrecisionPolicy


@runtime_checkable
class ThreadLocalWrapper(Protocol):
    """A wrapper of every call with a part each worker thread enters itself (torch
    function modes are thread-local)."""

    def thread_context(self) -> contextlib.AbstractContextManager[object]: ...


class Removable(Protocol):
    """A hook that can be taken off again (the casting's wrapped forwards)."""

    def remove(self) -> None: ...


@dataclass(frozen=True)
class ProgramExtras:
    """The pieces the options add to a device program (see module docstring)."""
    precision: PrecisionPolicy
    casting: AutocastRun  # entered around every call
    hooks: tuple[Removable, ...]  # the forwards the casting wrapped (removed when dropped)
    # entered around the device loop of every call
    wrappers: tuple[contextlib.AbstractContextManager[object], ...]
    # the thread-local part of the casting and wrappers (torch function modes),
    # entered in every worker thread of runners that have some
    worker_contexts: list[ContextFactory]
    finite_check: Callable[[UserOutput, list[tuple[str, torch.nn.Parameter]]], None] | None
    named_params: tuple[tuple[str, torch.nn.Parameter], ...]
    managed_step: Callable[[], object] | None  # replacing the optimizer's step
    call_profiler: CallProfiler | None
    trace: StepTrace | None  # the profiler's ranges around steps and micro-batches

    @property
    def wraps_calls(self) -> bool:
        """Whether something of ours runs around the forward passes of every call."""
        return bool(self.wrappers) or self.call_profiler is not None


def check_precompiled_inputs(precompiled: dict | None, args: tuple, kwargs: dict) -> None:
    """A model loaded from a precompiled file compiles only for the exported inputs
    (``poptorch.Error`` otherwise, before anything runs)."""
    if precompiled is not None and precompiled["signature"] is not None:
        precompiled["signature"].check(args, kwargs)


def program_source(backend: str, args: tuple, kwargs: dict, precompiled: dict | None,
                   options: OptionsView, key_parts: dict) -> ProgramSource:
    """The :py:class:`ProgramSource` of a model compiled for these inputs;
    ``key_parts`` name the model in the executable cache (training, model, optimizer,
    version; the options, as ``toDict()``, are added here when a cache is used)."""
    cache_dir = options.executable_cache_dir
    return ProgramSource(
        backend=backend, signature=InputSignature.of(args, kwargs),
        precompiled=precompiled, cache_dir=cache_dir,
        key_parts={"inputs": (args, kwargs),
                   "options": None if cache_dir is None else options.toDict(),
                   **key_parts})


def overlap_settings(options: OptionsView, output_mode: OutputMode) -> OverlapSettings:
    """The options the rules of the ``set_overlap_for_input`` /
    ``set_overlap_for_output`` markers read (``_runtime/program/overlapped_io.py``),
    checked on the captured graph or on the first forward."""
    return OverlapSettings(
        pipelined=options._execution_strategy.schedule_kind == PIPELINED,
        io_tiles=options.TensorLocations.num_io_tiles, output_mode=output_mode)


def program_extras(plan: BatchPlan, *, model: torch.nn.Module, user_model: torch.nn.Module,
                   config: RuntimeConfig, training: bool, device: torch.device,
                   optimizer: Callable[[], torch.optim.Optimizer | None],
                   cross: DataParallelGroup | StageReplicaGroup | None, groupings: dict | None,
                   name: str, popart_options: dict, unsplit: bool,
                   executed: Callable[[], ScheduleRecord | None]) -> ProgramExtras:
    """Precision policy, casting, strided group norm, tensor locations and profiling,
    as the options ask. ``optimizer()`` is the device optimizer in force (None for
    inference). The casting's wrapped forwards are removed again if this fails."""
    from .._runtime.numerics.precision import PrecisionPolicy
    policy = PrecisionPolicy(config.precision, model, training, device)
    policy.prepare_optimizer(optimizer())
    wrappers: list[contextlib.AbstractContextManager[object]] = \
        [policy] if policy.active else []
    from ..autocasting import prepare_model
    casting, hooks = prepare_model(model, user_model, config.precision)
    try:
        thread_contexts = () if casting.thread_context is None else \
            (casting.thread_context,)
        from .._runtime.numerics import strided_group_norm
        if strided_group_norm.wanted(popart_options):
            wrappers.append(strided_group_norm.StridedGroupNorm())
        from .._runtime.memory.locations import install as install_locations
        locations = install_locations(model, config.locations, groupings, device,
                                      training=training, optimizer=optimizer, cross=cross,
                                      replicas=plan.replication_factor, host=user_model,
                                      unsplit=unsplit)
        wrappers.extend(locations.wrappers)
        hooks = [*hooks, *locations.hooks]
        profiler = trace = None
        directory = profile_directory(config)
        if directory is not None:
            trace = StepTrace(plan.per_step, plan.replication_factor, executed)
            profiler = CallProfiler(directory, name, trace)
            wrappers.insert(0, profiler)
    except BaseException:
        for handle in hooks:
            handle.remove()
        raise
    worker_contexts = list(thread_contexts) + [
        w.thread_context for w in wrappers if isinstance(w, ThreadLocalWrapper)]
    return ProgramExtras(
        precision=policy, casting=casting, hooks=tuple(hooks),
        wrappers=tuple(wrappers), worker_contexts=worker_contexts,
        finite_check=policy.check_step if policy.checks_finite else None,
        named_params=tuple(model.named_parameters()) if policy.checks_finite else (),
        managed_step=locations.managed_step, call_profiler=profiler, trace=trace)
