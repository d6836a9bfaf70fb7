"""What a compiled model adds around its device program when its options or its
origin ask: precision and casting, profiling
(``_runtime/tracing.py``) and the source of its compiled program, a precompiled file or
the executable cache (``_runtime/executable/``)."""
from __future__ import annotations

from typing import Any

from .._runtime.executable.signature import InputSignature
from .._runtime.executable.source import ProgramSource
from .._runtime.placement.strategy import PIPELINED, kind_of
from .._runtime.program.overlapped_io import OverlapCheck, OverlapSettings
from .._runtime.tracing import CallProfiler, TracingRunner, profile_directory


def install_profiling(executor: Any, program: Any) -> None:
    """Profile every call when ``enableProfiling`` / ``POPLAR_ENGINE_OPTIONS`` /
    ``PVTI_OPTIONS`` say so (nothing is installed otherwise)."""
    directory = profile_directory(executor._config)
    if directory is None:
        return
    plan = program.plan
    runner = TracingRunner(program.runner, plan.per_step, plan.replication_factor)
    program.runner = runner
    program.wrappers.insert(0, CallProfiler(directory, executor._model_name(), program,
                                            runner))


def check_precompiled_inputs(executor: Any, args: tuple, kwargs: dict) -> None:
    """A model loaded from a precompiled file compiles only for the exported inputs
    (``poptorch.Error`` otherwise, before anything runs)."""
    precompiled = executor._pending_precompiled
    if precompiled is not None and precompiled["signature"] is not None:
        precompiled["signature"].check(args, kwargs)


def program_source(executor: Any, args: tuple, kwargs: dict) -> ProgramSource:
    """The :py:class:`ProgramSource` of a model compiled for these inputs."""
    precompiled, executor._pending_precompiled = executor._pending_precompiled, None
    d = executor  # (the executor's compile-time state)
    return ProgramSource(
        backend=d._backend, signature=InputSignature.of(args, kwargs),
        precompiled=precompiled,
        cache_dir=d._options.executable_cache_dir,
        key_parts={"inputs": (args, kwargs), "training": d._training,
                   "options": d._options, "model": d._model,
                   "optimizer": d._optimizer, "version": d._poptorch_version})


def overlap_check(executor: Any) -> OverlapCheck:
    """The check of the ``set_overlap_for_input`` / ``set_overlap_for_output`` markers
    (PopTorch's compile-time rules, ``_runtime/program/overlapped_io.py``), entered around
    the executor's first run; that run is eager (the check is Python)."""
    d = executor  # (the executor's compile-time state)
    opts, program = d._options, d._program
    settings = OverlapSettings(
        pipelined=kind_of(opts._execution_strategy) == PIPELINED,
        io_tiles=opts.TensorLocations.num_io_tiles, output_mode=program.output_mode)
    if program.compiled is not None:
        program.compiled.run_next_call_eagerly()
    return OverlapCheck(d._model, settings)


def install_program_extras(executor: Any, program: Any) -> None:
    """Precision policy, casting, strided group norm and profiling: installed only when
    their options ask, so that a call without them costs nothing more."""
    from .._runtime.numerics.precision import PrecisionPolicy
    d = executor  # (the executor's compile-time state)
    model, opts = d._model, d._options
    policy = PrecisionPolicy(opts, model, d._training, d._device)
    d._precision = policy
    policy.prepare_optimizer(d._device_optimizer)
    if policy.active:
        program.wrappers.append(policy)
    _install_casting(executor, program, policy)
    from .._runtime.numerics import strided_group_norm
    if strided_group_norm.wanted(opts._Popart.options):
        program.wrappers.append(strided_group_norm.StridedGroupNorm())
    if policy.checks_finite:
        program.finite_check = policy.check_step
        program.named_params = list(model.named_parameters())
    from .._runtime.memory.locations import install as install_locations
    install_locations(program, model, opts, d._replica_groupings, d._device)
    install_profiling(executor, program)


def _install_casting(executor: Any, program: Any, policy: Any) -> None:
    """float16 rules and poptorch.autocast: one context entered around each call
    (``autocasting.prepare_model``)."""
    from ..autocasting import prepare_model
    d = executor  # (the executor's compile-time state)
    for handle in d._autocast_hooks or ():
        handle.remove()
    run, handles = prepare_model(d._model, d._user_model, d._options,
                                 policy.half_float_casting)
    d._autocast_hooks, d._casting = handles, run
    if run.thread_context is not None:
        program.thread_contexts.append(run.thread_context)
