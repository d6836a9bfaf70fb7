"""Shared by the tests of the ``fastest`` backend's trial (test_backend_choice.py,
test_fast_call.py): settle a traced model's trial with chosen timings."""


def settle_trial(pop, compiled_faster: bool):
    """Feed the trial of ``pop``'s compiled program timings that make the compiled path
    the faster one (or the slower one) and return that compiled program; the trial is
    then over."""
    compiled = pop._program.compiled
    trial = compiled.trial
    assert compiled._traced and trial is not None
    fast, slow = (1e-4, 2e-4) if compiled_faster else (2e-4, 1e-4)
    for _ in range(trial.SKIP + trial.CALLS):
        for use in (True, False):
            trial.pending = use
            trial.record(use, fast if use else slow)
    assert compiled.trial is None
    return compiled
