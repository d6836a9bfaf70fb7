"""Which backend runs each call of a model: :py:class:`BackendSelector`.

A model with a compiled backend runs its first call eagerly (it times the eager call
and creates the optimizer state); the pieces compile at the second call, inside the
probation of ``fallback.py``. With the ``fastest`` backend (the automatic choice,
``backend_choice.py``) the next calls are :py:class:`BackendTrial`'s: they alternate
between the compiled and the eager backend, each timed whole, and the faster one stays
for good. The choice is stored (``decisions.py``) so that a rerun on the same machine
takes the same path without measuring again. :py:class:`CrossProcessAgreement` keeps
the processes of a replicated training program on one path: they take it, or leave it,
at the same step.
"""
from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

from ..._logging import logger
from .backends import Backend
from .compiled_step import CompiledBackend
from .fallback import PROBATION_CALLS, Probation, compile_budget, warn_fallback

__all__ = ["BackendSelector", "BackendTrial", "CrossProcessAgreement"]


class BackendTrial:
    """The ``fastest`` backend's measurement for one model (docs/options.md).

    The calls alternate between the compiled backend and the eager one, each timed
    whole (the first ``SKIP`` of each side, with cold caches, are not counted). After
    ``CALLS`` timed calls of each, the backends are compared call pair by call pair: the
    median of the ratios of each compiled call's time to the eager call next to it.
    Pairing cancels load that drifts while the trial runs, and the median ignores a
    burst that hits a few calls. When the median ratio is within ``CLOSE`` of 1, ``CALLS``
    more of each are timed, up to ``MAX_ROUNDS`` times, and the pairs of all of them
    decide. Every call of the trial is a real call with correct outputs."""

    CALLS = 6
    SKIP = 1
    CLOSE = 0.03
    MAX_ROUNDS = 3

    def __init__(self, decide: Callable[[float, int], None],
                 vote: Callable[[float], None] | None = None) -> None:
        self.decide = decide  # (ratio, processes): the selector keeps one backend
        self._vote = vote  # across processes: send the ratio instead of deciding
        self.times: dict[bool, list[float]] = {True: [], False: []}
        self._skip = {True: self.SKIP, False: self.SKIP}
        self.pending: bool | None = None  # the backend chosen for the coming call
        self._next = True
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
        if min(len(t) for t in self.times.values()) < self.CALLS * self._rounds:
            return
        ratio = self.ratio()
        if abs(ratio - 1.0) < self.CLOSE and self._rounds < self.MAX_ROUNDS:
            self._rounds += 1  # too close to call yet: measure both some more
            return
        if self._vote is not None:  # every process decides on the mean of the ratios
            self.voted = True
            self._vote(ratio)
            return
        self.decide(ratio, 1)

    def ratio(self) -> float:
        """The median of the paired compiled / eager call times so far."""
        return statistics.median(
            c / e for c, e in zip(self.times[True], self.times[False], strict=False))

    def medians_us(self) -> tuple[float, float, int]:
        """Both backends' median call times (microseconds) and the calls counted."""
        return (statistics.median(self.times[True]) * 1e6,
                statistics.median(self.times[False]) * 1e6, len(self.times[True]))


class BackendSelector:
    """Picks the backend of each call of one program (module docstring).

    ``compiled`` is None for a model that runs eagerly only. ``measure``: the trial
    decides (``fastest``); else the compiled backend is kept once its probation is over
    (``inductor``). ``decided`` is an earlier run's choice ("compiled" skips the trial;
    a model decided "eager" gets no compiled backend at all). ``on_decision(name,
    reason)`` is told the choice (the decision store)."""

    def __init__(self, eager: Backend, compiled: CompiledBackend | None, *, label: str,
                 measure: bool, params: list, buffers: list, device: Any,
                 cross: Any = None, decided: str | None = None,
                 on_decision: Callable[[str, str], None] | None = None,
                 progress: bool = False) -> None:
        self.eager = eager
        self.compiled = compiled
        self.label = label
        self._measure = measure and decided is None
        self._params, self._buffers, self._device = params, buffers, device
        self._on_decision = on_decision
        self._progress = progress
        self._first = compiled is not None  # the first call runs eagerly, timed
        self.trial: BackendTrial | None = None
        self.probation: Probation | None = None
        self._probation_left = 0
        self.failed = False  # a compiled piece failed on this process
        self.decision = "eager" if compiled is None else None
        self.agreement = None if cross is None or compiled is None else \
            CrossProcessAgreement(self, cross)

    @property
    def name(self) -> str:
        """The backend the model runs: "eager", "compiled", or "trial" while the
        trial measures, "compiling" before the compiled backend's probation ends."""
        if self.decision is not None:
            return self.decision
        return "trial" if self.trial is not None else "compiling"

    def for_call(self) -> Backend:
        """The backend of the coming call."""
        if self.compiled is None or self._first:
            return self.eager
        probation = self.probation
        if self.trial is not None:
            return probation if self.trial.next_turn() else self.eager  # type: ignore[return-value]  # (a trial runs only during a probation)
        if probation is not None:
            return probation
        return self.compiled

    def record(self, backend: Backend, seconds: float, microbatches: int) -> None:
        """A call of ``backend`` took ``seconds`` for ``microbatches`` micro-batches."""
        if self._first:
            self._first = False
            self._start_probation(seconds, max(1, microbatches))
            return
        probation = self.probation
        if probation is not None and backend is probation:
            seconds -= probation.take_overhead()  # (the guards are not the backend's)
        if self.trial is not None:
            self.trial.record(backend is probation, seconds)
        elif self.probation is not None and backend is self.probation:
            self._probation_left -= 1
            if self._probation_left <= 0:
                self._end_probation()

    def _start_probation(self, eager_seconds: float, microbatches: int) -> None:
        compiled = self.compiled
        assert compiled is not None  # (a first call eager before compiling)
        self.probation = Probation(
            compiled, self.eager, params=self._params, buffers=self._buffers,
            device=self._device, budget=compile_budget(eager_seconds),
            eager_microbatch_seconds=eager_seconds / microbatches, leave=self.fail,
            active=lambda: self.compiled is not None and not self.failed,
            progress=self._progress)
        self._probation_left = PROBATION_CALLS
        if self._measure:
            agreement = self.agreement
            self.trial = BackendTrial(self.decide,
                                      None if agreement is None else agreement.vote)

    def _end_probation(self) -> None:
        """The compiled backend passed its probation: it stays."""
        self.probation = None
        if self.decision is None:
            self.decision = "compiled"
            if self._on_decision is not None:
                self._on_decision("compiled", "compiled backend kept after its first calls")

    # ------------------------------------------------------------------ decisions
    def decide(self, ratio: float, processes: int) -> None:
        """The trial's decision: keep the compiled backend if ``ratio`` (compiled /
        eager; across processes the mean of theirs) is below 1."""
        trial = self.trial
        assert trial is not None  # (called by it)
        self.trial = None
        keep = ratio < 1.0
        compiled_us, eager_us, counted = trial.medians_us()
        logger.info("%s: the compiled backend takes %.0f us per call, the eager backend "
                    "%.0f us (medians of %d interleaved calls each; compiled / eager "
                    "%.3f%s): %s.", self.label, compiled_us, eager_us, counted, ratio,
                    f", the mean over {processes} processes" if processes > 1 else "",
                    "keeping the compiled backend" if keep else
                    "running the eager backend from now on")
        reason = f"trial: compiled / eager {ratio:.3f}"
        if keep:
            self.probation = None
            self.decision = "compiled"  # (across processes the agreement stays)
        else:
            self._drop()
            self.decision = "eager"
        if self._on_decision is not None:
            self._on_decision(self.decision, reason)

    def fail(self, stage: str, reason: str) -> None:
        """A compiled piece failed on this process (``fallback.Probation``): the model
        leaves the compiled backend for good (across processes: all of them, at the
        next reduction)."""
        if self.failed:
            return
        self.failed = True
        warn_fallback(self.label, stage, reason)
        if self.agreement is None:
            self.leave(f"{stage}: {reason}")

    def leave(self, reason: str) -> None:
        """Run the eager backend from now on (every process does at the same step)."""
        self._drop()
        self.decision = "eager"
        if self._on_decision is not None:
            self._on_decision("eager", reason)

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
    compiled piece failed, and each process's trial ratio. Every process sees the same
    sums at the same step, so all leave the compiled backend, or keep it, together; once
    they leave, DDP takes over the reduction (``distributed/replicas.py``)."""

    def __init__(self, selector: BackendSelector, cross: Any) -> None:
        self.selector = selector
        self.cross = cross
        self.processes = cross.world.size
        self.ratio: float | None = None
        cross.attach_agreement(self)

    def vote(self, ratio: float) -> None:
        """This process's trial ratio (compiled / eager), sent from the next step on."""
        self.ratio = ratio

    def local_values(self) -> tuple[float, float, float]:
        """(compiled piece failed here, voted, ratio): summed over the processes."""
        ratio = self.ratio
        return (1.0 if self.selector.failed else 0.0, 0.0 if ratio is None else 1.0,
                0.0 if ratio is None else ratio)

    def settle(self, totals: list[float]) -> None:
        """What every process concludes from the summed values of this step."""
        failed, votes, ratios = totals
        selector = self.selector
        if failed > 0:
            if not selector.failed:
                logger.info("%s: the compiled backend failed on another process; all "
                            "run the eager backend from now on.", selector.label)
            selector.leave("a compiled piece failed on some process")
        elif votes >= self.processes and selector.trial is not None:
            self.ratio = None
            selector.decide(ratios / self.processes, self.processes)

    def release(self) -> None:
        """The processes left the compiled backend: DDP may take the reduction over."""
        self.cross.attach_agreement(None)
