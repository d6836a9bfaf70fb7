"""Which path a compiled model keeps: the compiled device program or the eager loop.

:py:class:`BackendTrial` is the ``fastest`` backend's measurement (the automatic choice,
``backend_choice.py``): once the compiled program (``compiled_step.CompiledCall``) is
traced, the next calls alternate between it and the eager device loop and the faster
path stays. :py:class:`CrossProcessAgreement` keeps the processes of a replicated
training program on one path: they take it, or leave it, at the same step.
"""
from __future__ import annotations

import statistics
from typing import Any

from ..._logging import logger

__all__ = ["BackendTrial", "CrossProcessAgreement"]


class BackendTrial:
    """The ``fastest`` backend's choice for one model (docs/options.md), in inference
    and in training (each call runs whole on one path: a step is never half compiled).

    Once the compiled program is traced, the next calls alternate between it and the
    eager device loop, each timed whole (inputs to outputs; the first ``SKIP`` of each
    side, with cold caches, are not counted). After ``CALLS`` timed calls of each, the
    paths are compared call pair by call pair: the median of the ratios of each
    compiled call's time to the eager call next to it. Pairing cancels load that
    drifts while the trial runs, and the median ignores a burst that hits a few calls
    (the minimum of each side favours the path whose times spread more, which a
    compiled training step does on a busy machine). When the median ratio is within
    ``CLOSE`` of 1 the decision is not trusted yet: ``CALLS`` more of each are timed,
    up to ``MAX_ROUNDS`` times, and the pairs of all of them decide. The chosen path
    stays for good: the compiled program, or the eager loop (the program is dropped:
    ``program.compiled`` becomes None). One INFO line gives both paths' median times.
    Every call of the trial is a real call with correct outputs (the two paths agree
    within the compiled kernels' rounding). With replicas over several processes each
    process sends its ratio instead of deciding (:py:class:`CrossProcessAgreement`),
    and every process decides on the mean of them at the same step."""

    CALLS = 6
    SKIP = 1
    CLOSE = 0.03
    MAX_ROUNDS = 3

    def __init__(self, compiled: Any) -> None:
        self.compiled = compiled
        self.times: dict[bool, list[float]] = {True: [], False: []}
        self._skip = {True: self.SKIP, False: self.SKIP}
        self.pending: bool | None = None  # the path ready() chose for this call
        self._next = True
        self._rounds = 1
        self._voted = False  # across processes: the ratio is sent, the decision pending

    def next_turn(self) -> bool:
        """The path of the coming call (True: the compiled program)."""
        self.pending = use = self._next
        self._next = not use
        return use

    def record(self, used_compiled: bool, seconds: float) -> None:
        """The time of a call that followed :py:meth:`next_turn`; decides at the end."""
        pending, self.pending = self.pending, None
        if pending is None or pending != used_compiled or self.compiled.failed \
                or self._voted:
            return
        if self._skip[used_compiled]:
            self._skip[used_compiled] -= 1
            return
        self.times[used_compiled].append(seconds)
        if min(len(t) for t in self.times.values()) < self.CALLS * self._rounds:
            return
        ratio = statistics.median(
            c / e for c, e in zip(self.times[True], self.times[False], strict=False))
        if abs(ratio - 1.0) < self.CLOSE and self._rounds < self.MAX_ROUNDS:
            self._rounds += 1  # too close to call yet: measure both some more
            return
        agreement = self.compiled.agreement
        if agreement is not None:  # every process decides on the mean of the ratios
            self._voted = True
            agreement.vote(ratio)
            return
        self.decide(ratio)

    def decide(self, ratio: float, processes: int = 1) -> None:
        """Keep the compiled program if ``ratio`` (compiled / eager; across processes
        the mean of theirs) is below 1, else run the eager loop from now on."""
        compiled = self.compiled
        compiled.trial = None
        keep = ratio < 1.0
        logger.info("%s: the compiled program takes %.0f us per call, the eager device "
                    "loop %.0f us (medians of %d interleaved calls each; compiled / eager "
                    "%.3f%s): %s.", compiled.name,
                    statistics.median(self.times[True]) * 1e6,
                    statistics.median(self.times[False]) * 1e6, len(self.times[True]),
                    ratio, f", the mean over {processes} processes" if processes > 1 else "",
                    "keeping the compiled program" if keep else
                    "running the eager loop from now on")
        if not keep:
            compiled.leave()


class CrossProcessAgreement:
    """Keeps the processes of a replicated training program on one path.

    Each process may take the compiled program or the eager loop for a call (the trial
    alternates them; a capture can fail on one process only), so while the compiled
    program may run, every step reduces its gradients with the reducer, the one
    collective both paths call alike (DDP's hooks would see only the eager path's
    backward passes). What the processes must agree on travels with each step's
    gradients (``GradientReducer``'s extra values), not in collectives of its own:
    whether some process's capture failed, and each process's trial ratio. Every
    process sees the same sums at the same step, so all leave the compiled program, or
    keep it, together; once they leave, DDP takes over the reduction (``replicas``)."""

    def __init__(self, compiled: Any, cross: Any) -> None:
        self.compiled = compiled
        self.cross = cross
        self.processes = cross.world.size
        self.ratio: float | None = None
        cross.agreement = self  # (no DDP while it is set)

    def vote(self, ratio: float) -> None:
        """This process's trial ratio (compiled / eager), sent from the next step on."""
        self.ratio = ratio

    def local_values(self) -> tuple[float, float, float]:
        """(capture failed here, voted, ratio): summed over the processes."""
        ratio = self.ratio
        return (1.0 if self.compiled.failed else 0.0, 0.0 if ratio is None else 1.0,
                0.0 if ratio is None else ratio)

    def settle(self, totals: list[float]) -> None:
        """What every process concludes from the summed values of this step."""
        failed, votes, ratios = totals
        compiled = self.compiled
        if failed > 0:
            if not compiled.failed:
                logger.info("%s: the device program could not be compiled on every "
                            "process; all run the eager device loop from now on.",
                            compiled.name)
            compiled.leave()
        elif votes >= self.processes and compiled.trial is not None:
            self.ratio = None
            compiled.trial.decide(ratios / self.processes, self.processes)

    def release(self) -> None:
        """The processes left the compiled program: DDP may take the reduction over."""
        self.cross.agreement = None
