"""What a compiled model adds around its device program when its options or its
origin ask: profiling (``_runtime/tracing.py``) and the source of its compiled program,
a precompiled file or the executable cache (``_runtime/executable/``)."""
from __future__ import annotations

from typing import Any

from .._runtime.executable.signature import InputSignature
from .._runtime.executable.source import ProgramSource
from .._runtime.tracing import CallProfiler, TracingRunner, profile_directory


def install_profiling(executor: Any, program: Any) -> None:
    """Profile every call when ``enableProfiling`` / ``POPLAR_ENGINE_OPTIONS`` /
    ``PVTI_OPTIONS`` say so (nothing is installed otherwise)."""
    directory = profile_directory(executor._options)
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
    precompiled = executor.__dict__.get("_pending_precompiled")
    if precompiled is not None and precompiled["signature"] is not None:
        precompiled["signature"].check(args, kwargs)


def program_source(executor: Any, args: tuple, kwargs: dict) -> ProgramSource:
    """The :py:class:`ProgramSource` of a model compiled for these inputs."""
    d = executor.__dict__
    return ProgramSource(
        backend=d["_backend"], signature=InputSignature.of(args, kwargs),
        precompiled=d.pop("_pending_precompiled", None),
        cache_dir=d["_options"].executable_cache_dir,
        key_parts={"inputs": (args, kwargs), "training": d["_training"],
                   "options": d["_options"], "model": d["_model"],
                   "optimizer": d["_optimizer"], "version": d["_poptorch_version"]})
