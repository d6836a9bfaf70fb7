"""Shared by the tests of the ``fastest`` backend's trial (test_backend_choice.py,
test_fast_call.py): settle a model's trial with chosen timings."""


def settle_trial(pop, compiled_faster: bool):
    """Feed the trial of ``pop``'s backend selector timings that make the compiled
    backend the faster one (or the slower one) and return the selector; the trial is
    then over."""
    selector = pop._program.selector
    trial = selector.trial
    assert trial is not None, pop.backendInUse
    fast, slow = (1e-4, 2e-4) if compiled_faster else (2e-4, 1e-4)
    for _ in range(trial.SKIP + trial.CALLS):
        for use in (True, False):
            trial.pending = use
            trial.record(use, fast if use else slow)
    assert selector.trial is None
    assert pop.backendInUse == ("compiled" if compiled_faster else "eager")
    return selector


def compiled_running(pop) -> bool:
    """Whether ``pop``'s calls run the compiled backend (its probation included)."""
    return pop.backendInUse in ("compiled", "compiling") and \
        pop._program.selector.compiled is not None


def training_runner(pop):
    """The compiled backend's training runner of ``pop`` (``FusedMicrobatches``)."""
    return pop._program.selector.compiled.runner
