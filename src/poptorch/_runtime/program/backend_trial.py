"""Which backend runs each call of a model: :py:class:`BackendSelector`.

A model with a compiled backend runs its first call eagerly (it times the eager call
and creates the optimizer state); the pieces compile at the second call, inside the
probation of ``fallback.py`` (guarded, not timed). With the ``fastest`` backend (the
automatic choice, ``backend_choice.py``) the calls after the probation are
:py:class:`BackendTrial`'s: they alternate between the compiled backend, run as it runs
once chosen (no guards), and the eager one, each timed whole. The compiled backend
stays only when it is faster by more than the measurement's own spread.

Steady state confirms the choice: when the trial was close (or the choice came from an
earlier run), a short check of the same kind runs after ``CHECK_AFTER`` calls, and
again after four times as many, up to ``CHECKS`` times; a check that finds the other
backend faster by more than its spread switches to it (one INFO line). The choice is
stored (``executable/decisions.py``) as the next run's starting point, which that run's
check confirms. :py:class:`CrossProcessAgreement` keeps the processes of a replicated
training program on one path: they take it, or leave it, at the same step.
"""
from __future__ import annotations

import enum
import math
import statistics
from collections.abc import Callable
from typing import Any

import torch

from ..._logging import logger
from ..executable.decisions import Decision
from .backends import Backend
from .compiled_step import CompiledBackend
from .fallback import (
    PROBATION_CALLS,
    TRIAL_PROBATION_CALLS,
    Probation,
    compile_budget,
    warn_fallback,
)

__all__ = ["BackendSelector", "BackendTrial", "CrossProcessAgreement", "TrialState"]

CHECK_AFTER = 100
"""Calls on the chosen backend before its first steady-state check."""
CHECKS = 3
"""Steady-state checks per run at most (after 100, 400 and 1,600 calls)."""
RECHECK_WITHIN = 0.15
"""A trial ratio this close to 1 (either side) is checked again in steady state."""


class TrialState(enum.Enum):
    """Where a model's backend selection stands."""

    FIRST = "first"  # the first call runs eagerly, timed (it sets the compile budget)
    COMPILING = "compiling"  # compiled calls under probation: guarded, not timed
    TRIAL = "trial"  # the compiled and eager backends alternate, timed
    COMPILED = "compiled"  # the compiled backend runs (a check may time eager calls)
    EAGER = "eager"  # the eager backend runs (a check may time compiled calls)
    FAILED = "failed"  # a compiled piece failed here: eager until the processes leave


class BackendTrial:
    """A measurement of the compiled backend against the eager one (docs/options.md).

    The calls alternate between the two, each timed whole (the first ``skip`` of each
    side, with cold caches, are not counted). After ``calls`` timed calls of each, the
    backends are compared call pair by call pair: the median of the ratios of each
    compiled call's time to the eager call next to it. Pairing cancels load that drifts
    while the trial runs, and the median ignores a burst that hits a few calls. Its
    spread, the ``band``, is a 95% interval of that median estimated from the pairs'
    median absolute deviation (at least ``MIN_BAND``). When the ratio is within the band
    of 1, ``calls`` more of each are timed, up to ``rounds`` times, and the pairs of all
    of them decide. Every call is a real call with correct outputs."""

    CALLS = 6
    SKIP = 1
    MAX_ROUNDS = 3
    MIN_BAND = 0.02
    _MEDIAN_95 = 1.96 * 1.2533 * 1.4826  # MAD -> standard error of a median -> 95%

    def __init__(self, decide: Callable[[float, float, int], None],
                 vote: Callable[[float, float], None] | None = None, *,
                 calls: int | None = None, rounds: int | None = None) -> None:
        self.decide = decide  # (ratio, band, processes): the selector settles
        self._vote = vote  # across processes: send the ratio instead of deciding
        self.calls = self.CALLS if calls is None else calls
        self.max_rounds = self.MAX_ROUNDS if rounds is None else rounds
        self.times: dict[bool, list[float]] = {True: [], False: []}
        self._skip = {True: self.SKIP, False: self.SKIP}
        self.pending: bool | None = None  # the backend chosen for the coming call
        self._next = False  # (eager first: the compiled backend ran the calls before)
        self._rounds = 1
        self.voted = False

    def next_turn(self) -> bool:
        """The backend of the coming call (True: the compiled one)."""
        self.pending = use = self._next
        self._next = not use
        return use

    def record(self, used_compiled: bool, seconds: float) -> None:
        """The time of a call that followed :py:meth:`next_turn`; decides at the end."""
        pending, self.pending = self.pending, None
        if pending is None or pending != used_compiled or self.voted:
            return
        if self._skip[used_compiled]:
            self._skip[used_compiled] -= 1
            return
        self.times[used_compiled].append(seconds)
        if min(len(t) for t in self.times.values()) < self.calls * self._rounds:
            return
        ratio, band = self.ratio()
        if abs(ratio - 1.0) <= band and self._rounds < self.max_rounds:
            self._rounds += 1  # too close to call yet: measure both some more
            return
        if self._vote is not None:  # every process decides on the mean of the ratios
            self.voted = True
            self._vote(ratio, band)
            return
        self.decide(ratio, band, 1)

    def ratio(self) -> tuple[float, float]:
        """The median of the paired compiled / eager call times so far, and its band."""
        ratios = [c / e for c, e in zip(self.times[True], self.times[False], strict=False)]
        median = statistics.median(ratios)
        spread = statistics.median(abs(r - median) for r in ratios)
        return median, max(self.MIN_BAND, self._MEDIAN_95 * spread / math.sqrt(len(ratios)))

    def medians_us(self) -> tuple[float, float, int]:
        """Both backends' median call times (microseconds) and the calls counted."""
        return (statistics.median(self.times[True]) * 1e6,
                statistics.median(self.times[False]) * 1e6, len(self.times[True]))


class BackendSelector:
    """Picks the backend of each call of one program (module docstring).

    ``compiled`` is None for a model that runs eagerly only. ``measure``: the trial
    decides (``fastest``); else the compiled backend is kept once its probation is over
    (``inductor``). ``decided`` is an earlier run's decision: "compiled" skips the
    trial and is checked in steady state; "eager" came with no compiled backend.
    ``on_decision(decision, reason)`` is told each choice (the decision store)."""

    def __init__(self, eager: Backend, compiled: CompiledBackend | None, *, label: str,
                 measure: bool, params: list, buffers: list, device: torch.device,
                 cross: Any = None, decided: Decision | None = None,
                 on_decision: Callable[[Decision, str], None] | None = None,
                 progress: bool = False) -> None:
        self.eager = eager
        self.compiled = compiled
        self.label = label
        self._measure = measure and decided is None
        self._checks_left = CHECKS if measure else 0
        self._params, self._buffers, self._device = params, buffers, device
        self._on_decision = on_decision
        self._progress = progress
        self._stored = decided is not None
        self.state = TrialState.EAGER if compiled is None else TrialState.FIRST
        # the backend every call runs while nothing is measured (None: see for_call)
        self.steady: Backend | None = eager if compiled is None else None
        self.trial: BackendTrial | None = None  # the trial, or a steady-state check
        self.probation: Probation | None = None
        self._calls_left = 0  # in the probation, or before the next check (0: none)
        self.agreement = None if cross is None or compiled is None else \
            CrossProcessAgreement(self, cross)

    @property
    def name(self) -> str:
        """The backend the model runs (``backendInUse``): "eager", "compiled", "trial"
        while the trial measures, "compiling" before a forced compiled backend's
        probation ends."""
        state = self.state
        if state is TrialState.COMPILED or state is TrialState.EAGER:
            return state.value
        return "trial" if self._measure else "compiling"

    @property
    def decision(self) -> str | None:
        """"compiled" or "eager" once chosen and while no check measures (CUDA graphs
        are recorded then, and a saved model carries it); None before."""
        state = self.state
        if self.trial is None and state in (TrialState.COMPILED, TrialState.EAGER):
            return state.value
        return None

    @property
    def failed(self) -> bool:
        """Whether a compiled piece failed on this process (the processes have not
        left the compiled backend yet)."""
        return self.state is TrialState.FAILED

    def for_call(self) -> Backend:
        """The backend of the coming call."""
        steady = self.steady
        if steady is not None:
            return steady
        trial = self.trial
        if trial is not None:
            compiled = self.compiled
            assert compiled is not None  # (a trial measures the compiled backend)
            return compiled if trial.next_turn() else self.eager
        state = self.state
        if state is TrialState.COMPILING and self.probation is not None:
            return self.probation
        return self.eager  # the first call, or a failed compiled piece

    def record(self, backend: Backend, seconds: float, microbatches: int) -> None:
        """A call of ``backend`` took ``seconds`` for ``microbatches`` micro-batches."""
        if self.steady is not None:
            left = self._calls_left
            if left:
                self._calls_left = left - 1
                if left == 1:
                    self._start_check()
            return
        trial = self.trial
        if trial is not None:
            trial.record(backend is self.compiled, seconds)
            return
        state = self.state
        if state is TrialState.FIRST:
            self._start_probation(seconds, max(1, microbatches))
        elif state is TrialState.COMPILING and backend is self.probation:
            self._calls_left -= 1
            if self._calls_left <= 0:
                self._end_probation()

    # ------------------------------------------------------------------ the states
    def _start_probation(self, eager_seconds: float, microbatches: int) -> None:
        compiled = self.compiled
        assert compiled is not None  # (a first call eager before compiling)
        self.probation = Probation(
            compiled, self.eager, params=self._params, buffers=self._buffers,
            device=self._device, budget=compile_budget(eager_seconds),
            eager_microbatch_seconds=eager_seconds / microbatches, leave=self.fail,
            active=lambda: self.state is TrialState.COMPILING,
            progress=self._progress)
        self.state = TrialState.COMPILING
        self._calls_left = TRIAL_PROBATION_CALLS if self._measure else PROBATION_CALLS

    def _end_probation(self) -> None:
        """The compiled backend passed its probation: measured against the eager one
        (``fastest``), else kept (an earlier run's choice is checked later)."""
        self.probation = None
        if self._measure:
            self.state = TrialState.TRIAL
            self.trial = self._measurement(None)
            return
        self._run(TrialState.COMPILED, check=self._stored)

    def _measurement(self, calls: int | None) -> BackendTrial:
        agreement = self.agreement
        return BackendTrial(self.decide, None if agreement is None else agreement.vote,
                            calls=calls, rounds=None if calls is None else 1)

    def _run(self, state: TrialState, check: bool) -> None:
        """Run ``state``'s backend from now on; a steady-state check comes later when
        ``check`` and checks are left (the interval grows fourfold each time)."""
        self.state = state
        self.trial = None
        self.steady = self.compiled if state is TrialState.COMPILED else self.eager
        self._calls_left = 0
        if check and self._checks_left > 0:
            self._calls_left = CHECK_AFTER * 4 ** (CHECKS - self._checks_left)

    def _start_check(self) -> None:
        """A few timed calls of each backend, alternating (``decide`` settles)."""
        self._checks_left -= 1
        self.steady = None
        self.trial = self._measurement(BackendTrial.CALLS // 2 + 1)

    # ------------------------------------------------------------------ decisions
    def decide(self, ratio: float, band: float, processes: int) -> None:
        """A measurement's result: ``ratio`` is compiled / eager (across processes the
        mean of theirs), ``band`` its spread. The trial keeps the compiled backend when
        it is faster by more than the band; a check switches backend only when the
        other one is faster by more than the band."""
        trial = self.trial
        assert trial is not None  # (called by it)
        checking = self.state is not TrialState.TRIAL
        current = self.state
        if ratio < 1.0 - band:
            keep = TrialState.COMPILED
        elif ratio > 1.0 + band or not checking:
            keep = TrialState.EAGER
        else:
            keep = current
        close = abs(ratio - 1.0) < RECHECK_WITHIN
        compiled_us, eager_us, counted = trial.medians_us()
        across = f", the mean over {processes} processes" if processes > 1 else ""
        what = "keeping the compiled backend" if keep is TrialState.COMPILED else \
            "running the eager backend from now on"
        reason = f"{'check' if checking else 'trial'}: compiled / eager {ratio:.3f}"
        if not checking:
            logger.info("%s: the compiled backend takes %.0f us per call, the eager "
                        "backend %.0f us (medians of %d interleaved calls each; compiled "
                        "/ eager %.3f +- %.3f%s): %s.", self.label, compiled_us, eager_us,
                        counted, ratio, band, across, what)
        elif keep is not current:
            logger.info("%s: steady-state check: the compiled backend takes %.0f us per "
                        "call, the eager backend %.0f us (compiled / eager %.3f +- %.3f%s)"
                        ": switching to the %s backend.", self.label, compiled_us,
                        eager_us, ratio, band, across, keep.value)
        if keep is TrialState.EAGER and not (close and self.agreement is None):
            self._drop()  # (clearly slower: its memory is freed, DDP may take over)
        self._run(keep, check=close)
        if self._on_decision is not None and (keep is not current or not checking):
            self._on_decision(Decision(keep.value, ratio), reason)

    def fail(self, stage: str, reason: str) -> None:
        """A compiled piece failed on this process (``fallback.Probation``): the model
        leaves the compiled backend for good (across processes: all of them, at the
        next reduction)."""
        if self.state is TrialState.FAILED or self.compiled is None:
            return
        self.state = TrialState.FAILED
        self.steady = None
        self.trial = None
        warn_fallback(self.label, stage, reason)
        if self.agreement is None:
            self.leave(f"{stage}: {reason}")

    def leave(self, reason: str) -> None:
        """Run the eager backend from now on (every process does at the same step)."""
        self._drop()
        self._run(TrialState.EAGER, check=False)
        if self._on_decision is not None:
            self._on_decision(Decision("eager", None), reason)

    def _drop(self) -> None:
        self.compiled = None
        self.trial = None
        self.probation = None
        if self.agreement is not None:
            self.agreement.release()


class CrossProcessAgreement:
    """Keeps the processes of a replicated training program on one backend.

    Each process may run a call on the compiled or the eager backend (the trial
    alternates them; a compiled piece may fail on one process only), so while the
    compiled backend may run, every step reduces its gradients with the reducer, the one
    collective both backends call alike (DDP's hooks would see only the eager
    backend's backward passes). What the processes must agree on travels with each
    step's gradients (``GradientReducer``'s extra values): whether some process's
    compiled piece failed, and each process's measured ratio and band. Every process
    sees the same sums at the same step, so all leave the compiled backend, or keep it,
    together; once they leave, DDP takes over the reduction (``distributed/replicas.py``)."""

    def __init__(self, selector: BackendSelector, cross: Any) -> None:
        self.selector = selector
        self.cross = cross
        self.processes = cross.world.size
        self.ratio: tuple[float, float] | None = None
        cross.attach_agreement(self)

    def vote(self, ratio: float, band: float) -> None:
        """This process's measured ratio (compiled / eager) and band, sent from the next
        step on."""
        self.ratio = (ratio, band)

    def local_values(self) -> tuple[float, float, float, float]:
        """(compiled piece failed here, voted, ratio, band): summed over the processes."""
        voted = self.ratio
        return (1.0 if self.selector.failed else 0.0, 0.0 if voted is None else 1.0,
                0.0 if voted is None else voted[0], 0.0 if voted is None else voted[1])

    def settle(self, totals: list[float]) -> None:
        """What every process concludes from the summed values of this step."""
        failed, votes, ratios, bands = totals
        selector = self.selector
        if failed > 0:
            if not selector.failed:
                logger.info("%s: the compiled backend failed on another process; all "
                            "run the eager backend from now on.", selector.label)
            selector.leave("a compiled piece failed on some process")
        elif votes >= self.processes and selector.trial is not None:
            self.ratio = None
            selector.decide(ratios / self.processes, bands / self.processes,
                            self.processes)

    def release(self) -> None:
        """The processes left the compiled backend: DDP may take the reduction over."""
        self.cross.attach_agreement(None)
