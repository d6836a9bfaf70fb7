"""Shared by the tests of the ``fastest`` backend's trial (test_backend_choice.py,
test_fast_call.py): settle a model's trial with chosen timings."""
from poptorch._runtime.program.backend_trial import TrialState


def settle_trial(pop, compiled_faster: bool, ratio: float = 0.5):
    """Count the probation of ``pop``'s compiled backend as passed, feed its trial
    timings that make the compiled backend the faster one (compiled / eager =
    ``ratio``) or the slower one (eager / compiled = ``ratio``), and return the
    selector; the trial is then over."""
    selector = pop._program.selector
    while selector.state is TrialState.COMPILING:
        selector.record(selector.probation, 0.0, 1)
    trial = selector.trial
    assert trial is not None and selector.state is TrialState.TRIAL, pop.backendInUse
    fast, slow = (1e-4 * ratio, 1e-4)
    for _ in range(trial.SKIP + trial.calls):
        for use in (True, False):
            trial.pending = use
            trial.record(use, fast if use == compiled_faster else slow)
    assert selector.trial is None
    assert pop.backendInUse == ("compiled" if compiled_faster else "eager")
    return selector


def compiled_running(pop) -> bool:
    """Whether ``pop``'s calls run the compiled backend (its probation included)."""
    return pop.backendInUse in ("compiled", "compiling") and \
        pop._program.selector.compiled is not None


def training_runner(pop):
    """The compiled backend's training compute of ``pop`` (``FusedCompute``)."""
    return pop._program.selector.compiled.compute
