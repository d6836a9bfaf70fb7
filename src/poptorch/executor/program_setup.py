"""What a compiled model adds around its device program when its options or its
origin ask: precision and casting, profiling
(``_runtime/tracing.py``) and the source of its compiled program, a precompiled file or
the executable cache (``_runtime/executable/``)."""
from __future__ import annotations

from typing import Any

import torch

from .._runtime.config import RuntimeConfig
from .._runtime.executable.signature import InputSignature
from .._runtime.executable.source import ProgramSource
from .._runtime.placement.strategy import PIPELINED, kind_of
from .._runtime.program.overlapped_io import OverlapSettings  # placement helper: lead re-applies
from .._runtime.tracing import CallProfiler, TracingRunner, profile_directory


def install_profiling(program: Any, config: RuntimeConfig, name: str) -> None:
    """Profile every call when ``enableProfiling`` / ``POPLAR_ENGINE_OPTIONS`` /
    ``PVTI_OPTIONS`` say so (nothing is installed otherwise)."""
    directory = profile_directory(config)
    if directory is None:
        return
    plan = program.plan
    runner = TracingRunner(program.runner, plan.per_step, plan.replication_factor)
    program.runner = runner
    program.wrappers.insert(0, CallProfiler(directory, name, program, runner))


def check_precompiled_inputs(precompiled: dict | None, args: tuple, kwargs: dict) -> None:
    """A model loaded from a precompiled file compiles only for the exported inputs
    (``poptorch.Error`` otherwise, before anything runs)."""
    if precompiled is not None and precompiled["signature"] is not None:
        precompiled["signature"].check(args, kwargs)


def program_source(backend: str, args: tuple, kwargs: dict, precompiled: dict | None,
                   options: Any, key_parts: dict) -> ProgramSource:
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


# placement helper: lead re-applies (this function, replacing overlap_check)
def overlap_settings(options: Any, output_mode: Any) -> OverlapSettings:
    """The options the rules of the ``set_overlap_for_input`` /
    ``set_overlap_for_output`` markers read (``_runtime/program/overlapped_io.py``),
    checked on the captured graph or on the first forward."""
    return OverlapSettings(
        pipelined=kind_of(options._execution_strategy) == PIPELINED,
        io_tiles=options.TensorLocations.num_io_tiles, output_mode=output_mode)


# placement helper: lead re-applies (this function)
def run_checked_call_eagerly(program: Any) -> None:
    """The call that checks the markers on its first forward runs on the eager loop (the
    check is Python; a compiled whole call never calls the runner)."""
    if program.compiled is not None:
        program.compiled.run_next_call_eagerly()


def install_program_extras(program: Any, *, model: torch.nn.Module,
                           user_model: torch.nn.Module, config: RuntimeConfig,
                           training: bool, device: torch.device, optimizer: Any,
                           groupings: dict | None, name: str, popart_options: dict
                           ) -> tuple[Any, Any, list]:
    """Precision policy, casting, strided group norm, tensor locations and profiling:
    installed only when their options ask, so that a call without them costs nothing
    more. ``optimizer`` is the device optimizer (None for inference). Returns the
    precision policy, the casting context entered around each call and the handles of
    the forwards the casting wrapped (removed when the compilation is dropped)."""
    from .._runtime.numerics.precision import PrecisionPolicy
    policy = PrecisionPolicy(config.precision, model, training, device)
    policy.prepare_optimizer(optimizer)
    if policy.active:
        program.wrappers.append(policy)
    from ..autocasting import prepare_model
    casting, hooks = prepare_model(model, user_model, config.precision)
    try:
        if casting.thread_context is not None:
            program.thread_contexts.append(casting.thread_context)
        from .._runtime.numerics import strided_group_norm
        if strided_group_norm.wanted(popart_options):
            program.wrappers.append(strided_group_norm.StridedGroupNorm())
        if policy.checks_finite:
            program.finite_check = policy.check_step
            program.named_params = list(model.named_parameters())
        from .._runtime.memory.locations import install as install_locations
        install_locations(program, model, config.locations, groupings, device)
        install_profiling(program, config, name)
    except BaseException:
        for handle in hooks:
            handle.remove()
        raise
    return policy, casting, hooks
