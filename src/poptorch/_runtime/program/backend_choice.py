"""The automatic backend: what compiles a model whose options choose no backend.

A PopTorch program accepts a compile at its first call in order to be fast afterwards,
so with neither ``Options.Jit.backend`` nor ``POPTORCH_BACKEND`` set the model is run the
way its own first calls show to be fastest. That is the ``fastest`` backend
(``backend_trial.BackendTrial``): the whole call is compiled as one program, and once it
has passed its probation the next calls alternate between it and the eager device loop,
each timed whole; the compiled path stays only when it is faster by more than the
measurement's spread, with one INFO line giving both times, and a close choice is
checked again in steady state. An inference model and a training model are measured
alike. Each call of the trial runs entirely on one path (a training step is never half
compiled), so every call gives the results of that path.

An earlier run's choice (``executable/decisions.py``) is where a run starts: a stored
"compiled" skips the trial and is checked in steady state; a stored "eager" skips the
compile when the trial found the compiled backend clearly slower (or failing), and is
measured again when it was a close call.

Compiling needs code generation: inductor builds C++ on the CPU (and a C launcher for
its Triton kernels on GPUs). Where no compiler is found the model runs the eager
backend, with one INFO line saying so, instead of failing at its first call.
"""
from __future__ import annotations

import functools
from typing import Any

import torch

from ..._logging import info_once
from ..executable.decisions import Decision, DecisionStore
from ..torch_internals import inductor_cpp_compiler
from .backend_trial import RECHECK_WITHIN, BackendSelector
from .backends import EagerBackend, compile_blocker
from .compiled_step import CompiledBackend, torch_compile_backend, update_blocker
from .optimizer import OptimizerBinding

__all__ = ["automatic_backend", "make_selector", "missing_compiler"]


@functools.cache
def missing_compiler() -> str | None:
    """Why inductor cannot generate code on this machine (no C++ compiler found), or
    None when it can. Looked up once per process."""
    try:
        inductor_cpp_compiler()
    except Exception as error:
        first = str(error).strip().splitlines()
        return f"no C++ compiler was found ({first[0] if first else type(error).__name__})"
    return None


def automatic_backend(device: torch.device) -> str:
    """The backend of a model with no backend chosen: ``fastest`` (compile, keep the
    faster of the compiled program and the eager loop, measured over the first calls),
    or ``eager`` where code cannot be generated (logged once at INFO)."""
    if torch_compile_backend() == "inductor":
        reason = missing_compiler()
        if reason is not None:
            info_once(("automatic-backend", reason),
                      "Backend: eager (automatic choice). The compiled device program is "
                      "skipped: %s; install g++ (or set CXX) to let PopTorch measure it.",
                      reason)
            return "eager"
    return "fastest"


def make_selector(*, backend: str, plain: bool, eager: EagerBackend, model: torch.nn.Module,
                  training: bool, device: torch.device, label: str,
                  binding: OptimizerBinding | None, managed_step: bool,
                  wraps_calls: bool, params: list, buffers: list, cross: Any,
                  decisions: DecisionStore | None, decided: str | None,
                  progress: bool = False) -> BackendSelector:
    """The selector of a program whose options name ``backend`` ("eager", "inductor" or
    "fastest"). ``plain``: the program's runner is the one-stage interpreter over the
    model itself, the only one the compiled backend replaces (``compile_blocker``).
    ``decided``: the choice a precompiled file carries; else ``decisions`` holds an
    earlier run's choice, and is told this run's."""
    compiled = None
    earlier: Decision | None = None if decided is None else Decision(decided, None)
    if backend in ("inductor", "fastest"):
        reason = compile_blocker(plain, wraps_calls)
        if reason is not None:
            info_once(("compiled-blocked", label, reason), "%s: the eager backend runs "
                      "every call (%s).", label, reason)
        else:
            if earlier is None and backend == "fastest" and decisions is not None:
                earlier = _starting_point(decisions.read(device))
            if earlier is not None:
                info_once(("decided", label, earlier.backend), "%s: backend %s, as an "
                          "earlier run's trial decided%s.", label, earlier.backend,
                          " (checked again after its first calls)"
                          if earlier.backend == "compiled" else "")
            if earlier is None or earlier.backend != "eager":
                update_reason = None if not training else update_blocker(
                    binding.device if binding else None, managed_step)
                compiled = CompiledBackend(model, training, device, label, binding,
                                           eager.update if training else None,
                                           update_reason)
    write = None
    if decisions is not None and backend == "fastest":
        def write(decision: Decision, reason: str) -> None:
            decisions.write(decision, reason, device)
    return BackendSelector(eager, compiled, label=label, measure=backend == "fastest",
                           params=params, buffers=buffers, device=device, cross=cross,
                           decided=earlier, on_decision=write, progress=progress)


def _starting_point(stored: Decision | None) -> Decision | None:
    """Where a run starts from an earlier run's ``stored`` decision: a close "eager"
    is measured again (None); "compiled", a clear "eager" or a failure's are kept."""
    if stored is None or stored.backend == "compiled" or stored.ratio is None:
        return stored
    return stored if stored.ratio >= 1.0 + RECHECK_WITHIN else None
