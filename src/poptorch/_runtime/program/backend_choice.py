"""The automatic backend: what compiles a model whose options choose no backend.

A PopTorch program accepts a compile at its first call in order to be fast afterwards,
so with neither ``Options.Jit.backend`` nor ``POPTORCH_BACKEND`` set the model is run the
way its own first calls show to be fastest. That is the ``fastest`` backend
(``backend_trial.BackendTrial``): the whole call is compiled as one program, and once it
is traced the next calls alternate between it and the eager device loop, each timed
whole; the faster path stays for good, with one INFO line giving both times. An
inference model and a training model are measured alike. Each call of the trial runs
entirely on one path (a training step is never half compiled), so every call gives the
results of that path.

Compiling needs code generation: inductor builds C++ on the CPU (and a C launcher for
its Triton kernels on GPUs). Where no compiler is found the model runs the eager
backend, with one INFO line saying so, instead of failing at its first call.
"""
from __future__ import annotations

import functools
import os

import torch

from ..._logging import info_once
from ..torch_internals import inductor_cpp_compiler

__all__ = ["automatic_backend", "missing_compiler"]


def _torch_compile_backend() -> str:
    """The ``torch.compile`` backend the compiled program uses (``compiled_step``)."""
    return os.environ.get("POPTORCH_TORCH_COMPILE_BACKEND", "inductor")


@functools.cache
def missing_compiler() -> str | None:
    """Why inductor cannot generate code on this machine (no C++ compiler found), or
    None when it can. Looked up once per process."""
    try:
        inductor_cpp_compiler()
    except Exception as error:  # noqa: BLE001  (InvalidCxxCompiler, a broken toolchain probe)
        first = str(error).strip().splitlines()
        return f"no C++ compiler was found ({first[0] if first else type(error).__name__})"
    return None


def automatic_backend(device: torch.device) -> str:
    """The backend of a model with no backend chosen: ``fastest`` (compile, keep the
    faster of the compiled program and the eager loop, measured over the first calls),
    or ``eager`` where code cannot be generated (logged once at INFO)."""
    if _torch_compile_backend() == "inductor":
        reason = missing_compiler()
        if reason is not None:
            info_once(("automatic-backend", reason),
                      "Backend: eager (automatic choice). The compiled device program is "
                      "skipped: %s; install g++ (or set CXX) to let PopTorch measure it.",
                      reason)
            return "eager"
    return "fastest"
