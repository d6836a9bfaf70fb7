"""Every failure of the compiled backend falls back to eager, once, atomically.

During its first calls (``TRIAL_PROBATION_CALLS`` compiled calls before the backend
trial measures, ``PROBATION_CALLS`` when the compiled backend is forced) the compiled
backend runs inside a :py:class:`Probation`: each piece of each step is guarded by a
:py:class:`StateUndo` of what it may change. The piece is undone and run again eagerly,
and the model runs the eager backend for good (one WARNING naming the stage and the
reason), when:

* **capture**: dynamo cannot trace it (``torch._dynamo`` exceptions, ``Uncapturable``);
* **code generation**: the compiler backend fails (``BackendCompilerFailed``);
* **run**: the compiled piece raises anything else (an error out of generated code);
* **result check**: a compiled result is not finite (an output, a loss, a gradient,
  an updated weight) where the eager piece's, run again on the same inputs, is;
* **compile budget**: the compiles of the first calls took longer than the budget:
  ``POPTORCH_COMPILE_BUDGET`` seconds, else 1000 times the model's eager call
  (measured at the first call), at least 60 s and at most 30 min. A compile that costs
  more than a thousand eager calls will not pay for itself soon.

An exception that the eager rerun raises as well is the user's (bad data, an assert in
the model): it is raised as it is, the piece undone, and the model keeps its backend.

A step is undone at the level of its pieces, before the step's reduction between
processes: every process calls the same collectives whichever path it took, and the
processes leave the compiled backend together at the next reduction
(``backend_trial.CrossProcessAgreement``). The pieces' undo copies only what a compiled
attempt can change before it fails: the buffers and random state of the micro-batches
(gradients are cleared, not copied), the weights and optimizer state of the update.
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol, TypeVar

import torch

from ..._logging import describe_error, logger
from ..._typing import UserOutput
from ...errors import Error
from ..torch_internals import dynamo, pytree
from .compiled_step import CompiledBackend, Uncapturable
from .runner import LossOf
from .undo import RandomState, StateUndo

T = TypeVar("T")

if TYPE_CHECKING:
    from .backends import Backend

__all__ = ["PROBATION_CALLS", "TRIAL_PROBATION_CALLS", "Probation", "compile_budget"]

PROBATION_CALLS = 3
"""Compiled calls guarded after the compile when no trial runs (a forced backend)."""
TRIAL_PROBATION_CALLS = 2
"""Compiled calls guarded before the trial times them unguarded (the compile, and the
update's second call)."""
UPDATE_PROBATION = 2
"""Compiled updates guarded (their first compile and one more)."""
_MIN_BUDGET_S, _MAX_BUDGET_S, _BUDGET_FACTOR = 60.0, 1800.0, 1000.0


def compile_budget(eager_call_seconds: float) -> float:
    """Seconds the compiles of a model's first compiled calls may take (module
    docstring)."""
    setting = os.environ.get("POPTORCH_COMPILE_BUDGET", "").strip()
    if setting:
        try:
            return float(setting)
        except ValueError:
            raise Error(f"POPTORCH_COMPILE_BUDGET={setting!r}: give a number of seconds "
                        "(e.g. POPTORCH_COMPILE_BUDGET=600).") from None
    return min(_MAX_BUDGET_S, max(_MIN_BUDGET_S, _BUDGET_FACTOR * eager_call_seconds))


def stage_of(error: BaseException) -> str:
    """The stage a compiled piece failed in (module docstring)."""
    exc = dynamo().exc
    if isinstance(error, exc.BackendCompilerFailed):
        return "code generation"
    if isinstance(error, (exc.TorchDynamoException, Uncapturable)):
        return "capture"
    return "run"


def _finite(tensors: list[torch.Tensor]) -> bool:
    floating = [t for t in tensors if t.is_floating_point() or t.is_complex()]
    if not floating:
        return True
    return bool(torch.stack([torch.isfinite(t).all() for t in floating]).all())


def _tensors(structure: UserOutput) -> list[torch.Tensor]:
    return [t.detach() for t in pytree.tree_leaves(structure) if isinstance(t, torch.Tensor)]


class _ProgressBar(Protocol):
    """A ``tqdm`` bar, as the compile's progress shows it."""

    def close(self) -> None: ...


class _RecordingLoss:
    """A loss rule that keeps the losses it scales (the result check reads them)."""

    def __init__(self, rule: LossOf) -> None:
        self.rule = rule
        self.multiplier = rule.multiplier
        self.losses: list[torch.Tensor] = []

    def __call__(self, output: UserOutput) -> torch.Tensor:
        loss = self.rule(output)
        self.losses.append(loss.detach())
        return loss

    def finish(self, loss: torch.Tensor) -> torch.Tensor:
        scaled = self.rule.finish(loss)
        self.losses.append(scaled.detach())
        return scaled


class Probation:
    """The compiled backend during its first calls (module docstring): a ``Backend``
    whose pieces fall back to ``eager``'s. ``leave(stage, reason)`` is called once when
    one fails; after that (or once the selector has moved on) the pieces are the eager
    ones."""

    name = "compiled"

    def __init__(self, compiled: CompiledBackend, eager: Backend, *, params: list,
                 buffers: list, device: torch.device, budget: float,
                 eager_microbatch_seconds: float, leave: Callable[[str, str], None],
                 active: Callable[[], bool], progress: bool = False) -> None:
        self.compiled = compiled
        self.eager = eager
        self.params = params
        self.buffers = buffers
        self.device = device
        self.budget = budget
        self.eager_microbatch_seconds = eager_microbatch_seconds
        self.compile_seconds = 0.0
        self.updates_left = UPDATE_PROBATION
        self._compiled_once = False
        self._progress = progress  # PopTorch's progress bar over the first compile
        self._leave = leave
        self._active = active  # False once the selector left the probation
        self.runner = self._run_microbatches

    # ------------------------------------------------------------------ pieces
    def _run_microbatches(self, microbatches: list, loss_of: LossOf | None) -> list:
        if not self._active():
            return self.eager.runner(microbatches, loss_of)
        undo = StateUndo(self.buffers, rng=RandomState(self.device))
        recording = None if loss_of is None else _RecordingLoss(loss_of)
        bar = None if self._compiled_once else self._progress_bar()
        failure: BaseException | None = None
        t0 = time.perf_counter()
        try:
            outputs = self.compiled.runner(microbatches, recording)
        except Exception as error:
            failure = error
        finally:
            if bar is not None:
                bar.close()
        if failure is not None:  # (rerun outside the handler: the user's error is raised
            stage = stage_of(failure)  # without the compiled one as its context)
            reason = _reason(failure)
            failure = None
            return self._redo(undo, lambda: self.eager.runner(microbatches, loss_of),
                              stage, reason)
        took = time.perf_counter() - t0
        self.compile_seconds += max(
            0.0, took - self.eager_microbatch_seconds * len(microbatches))
        if not self._compiled_once:
            self._compiled_once = True
            count = len(microbatches)
            logger.info("%s: compiled backend: the first micro-batch compiled; its step "
                        "of %d micro-batch%s took %.1f s.", self.compiled.label, count,
                        "" if count == 1 else "es", took)
        if self.compile_seconds > self.budget:
            return self._redo(undo, lambda: self.eager.runner(microbatches, loss_of),
                              "compile budget", f"the compiles took "
                              f"{self.compile_seconds:.1f} s, over the budget of "
                              f"{self.budget:.0f} s")
        produced = _tensors(outputs) + (recording.losses if recording else [])
        produced += [p.grad for p in self.params if p.grad is not None]
        if not _finite(produced):
            undo.restore()
            self._clear_grads()
            again = self.eager.runner(microbatches, loss_of)
            if _finite(_tensors(again) + [p.grad for p in self.params
                                          if p.grad is not None]):
                self._leave("result check", "a compiled output, loss or gradient is not "
                            "finite where the eager backend's is")
            return again
        return outputs

    def _progress_bar(self) -> _ProgressBar:
        """The bar shown while the first compiled call compiles (its step's pieces)."""
        from tqdm import tqdm
        return tqdm(total=1, desc=f"Compiling the device program ({self.compiled.label})",
                    leave=False, unit="program", disable=not self._progress)

    def _redo(self, undo: StateUndo, eager: Callable[[], T], stage: str, reason: str,
              clear_grads: bool = True) -> T:
        """``eager()``: the failed piece again, eagerly, from its undone state. The
        compiled backend is left when it runs; an exception it raises as well is the
        user's, raised as it is (the piece undone again)."""
        def undone() -> None:
            undo.restore()
            if clear_grads:
                self._clear_grads()

        undone()
        try:
            again = eager()
        except BaseException:
            undone()
            raise
        self._leave(stage, reason)
        return again

    def _clear_grads(self) -> None:
        for p in self.params:
            p.grad = None

    def update(self) -> None:
        if not self._active() or self.updates_left <= 0:
            (self.compiled if self._active() else self.eager).update()
            return
        self.updates_left -= 1
        binding = self.compiled.binding
        optimizer = None if binding is None else binding.device
        undo = StateUndo(self.params, optimizer=optimizer)
        failure: BaseException | None = None
        try:
            self.compiled.update()
        except Exception as error:
            failure = error
        if failure is not None:
            stage, reason = f"update {stage_of(failure)}", _reason(failure)
            failure = None
            self._redo(undo, self.eager.update, stage, reason, clear_grads=False)
            return
        if not _finite(list(self.params)):
            undo.restore()
            self.eager.update()
            if _finite(list(self.params)):
                self._leave("update result check", "the compiled update gives weights "
                            "that are not finite where the eager update's are")


def _reason(error: BaseException | str) -> str:
    """``Type: first line`` of ``error`` (and of the error a compiler failure wraps)."""
    if isinstance(error, str):
        return error
    inner = getattr(error, "inner_exception", None)
    if isinstance(inner, BaseException):
        return f"{type(error).__name__}: {_reason(inner)}"
    return describe_error(error).strip()


def warn_fallback(label: str, stage: str, reason: str) -> None:
    """The one WARNING of a model that leaves the compiled backend."""
    logger.warning("%s: the compiled backend failed (%s: %s); the call was undone and "
                   "run again eagerly, and the model runs the eager backend from now on.",
                   label, stage, reason)
