"""The automatic backend (``_runtime/program/backend_choice.py``): with no backend
chosen, a model's first calls measure the compiled program against the eager loop, in
training as in inference, and every call matches plain PyTorch.

The tests trace with torch.compile's ``aot_eager`` backend (the same whole-call capture
as inductor without a C++ build), except where the compiler check itself is tested.
"""
import copy
import json
import logging

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from _backend_trial import compiled_running, settle_trial

import poptorch
from poptorch._runtime.program import backend_choice, backend_trial
from poptorch._runtime.program.backend_trial import BackendTrial, TrialState
from poptorch.executor.call_support import backend_name


@pytest.fixture
def automatic(monkeypatch):
    """No backend chosen (the test suite pins eager in tests/conftest.py)."""
    monkeypatch.delenv("POPTORCH_BACKEND", raising=False)
    monkeypatch.setenv("POPTORCH_TORCH_COMPILE_BACKEND", "aot_eager")


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(6, 8)
        self.bn = nn.BatchNorm1d(8)
        self.fc2 = nn.Linear(8, 3)

    def forward(self, x, y):
        out = self.fc2(self.bn(F.relu(self.fc1(x))))
        return out, F.cross_entropy(out, y)


def _opts(d=1, g=1):
    opts = poptorch.Options().deviceIterations(d)
    opts.Training.gradientAccumulation(g)
    opts.showCompilationProgressBar(False)
    return opts


def _decisions(caplog):
    return [r.getMessage() for r in caplog.records
            if "per call" in r.getMessage() and "eager backend" in r.getMessage()]


def test_automatic_backend_is_measured_where_a_compiler_exists(automatic, monkeypatch):
    assert backend_name(poptorch.Options(), torch.device("cpu")) == "fastest"
    monkeypatch.setenv("POPTORCH_BACKEND", "eager")  # a choice is kept as it is
    assert backend_name(poptorch.Options(), torch.device("cpu")) == "eager"
    opts = poptorch.Options()
    opts.Jit.backend("inductor")
    assert backend_name(opts, torch.device("cpu")) == "inductor"


def test_without_a_cpp_compiler_the_automatic_backend_is_eager(automatic, monkeypatch,
                                                                caplog):
    monkeypatch.setenv("POPTORCH_TORCH_COMPILE_BACKEND", "inductor")
    from torch._inductor import cpp_builder

    def no_compiler():
        raise RuntimeError("No working C++ compiler found in cpp_builder")
    monkeypatch.setattr(cpp_builder, "get_cpp_compiler", no_compiler)
    backend_choice.missing_compiler.cache_clear()
    try:
        poptorch.setLogLevel("INFO")
        with caplog.at_level(logging.INFO, logger="poptorch"):
            torch.manual_seed(0)
            model = Net().eval()
            x, y = torch.randn(4, 6), torch.randint(0, 3, (4,))
            pop = poptorch.inferenceModel(model, _opts())
            out, _ = pop(x, y)
            with torch.no_grad():
                torch.testing.assert_close(out, model(x, y)[0], rtol=0, atol=0)
        assert pop.backendInUse == "eager" and pop._program.selector.compiled is None
        lines = [r.getMessage() for r in caplog.records if "no C++ compiler" in
                 r.getMessage()]
        assert len(lines) <= 1 and all("Backend: eager" in line for line in lines)
        assert backend_choice.missing_compiler() is not None
    finally:
        poptorch.setLogLevel("WARN")
        backend_choice.missing_compiler.cache_clear()


@pytest.mark.parametrize("d,g", [(1, 1), (2, 3)])
def test_training_trial_matches_eager_and_plain_pytorch_and_decides_once(automatic, caplog,
                                                                         monkeypatch, d, g):
    """Calls alternate between the compiled backend and the eager one while measured:
    the outputs, weights and optimizer state stay exactly those of the eager backend
    (the same kernels under aot_eager) and those of plain PyTorch (within the rounding
    of the mean over micro-batches, accumulated over 48 steps)."""
    torch.manual_seed(1)
    model = Net()
    ref, eager_model = copy.deepcopy(model), copy.deepcopy(model)

    def make_opt(m):
        return torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.5, weight_decay=0.01)
    pop = poptorch.trainingModel(model, _opts(d, g), make_opt(model))
    eager_opts = _opts(d, g)
    eager_opts.Jit.backend("eager")
    eager = poptorch.trainingModel(eager_model, eager_opts, make_opt(eager_model))
    ref_opt = make_opt(ref)
    n = 4 * g
    # one round of the trial (its extension when close is tested with fed timings)
    monkeypatch.setattr(BackendTrial, "MAX_ROUNDS", 1)
    calls = 24  # 1 eager, 2 compiled on probation, 14 of the trial, 7 after
    poptorch.setLogLevel("INFO")
    try:
        with caplog.at_level(logging.INFO, logger="poptorch"):
            paths = []
            for _ in range(calls):
                x, y = torch.randn(d * n, 6), torch.randint(0, 3, (d * n,))
                trial = pop._program.selector.trial if pop._program is not None \
                    else None
                paths.append(None if trial is None else trial._next)
                out, loss = pop(x, y)
                eager_out, eager_loss = eager(x, y)
                for i in range(d):
                    ref_opt.zero_grad()
                    for xs, ys in zip(x[i * n:(i + 1) * n].chunk(g),
                                      y[i * n:(i + 1) * n].chunk(g), strict=False):
                        ref_out, ref_loss = ref(xs, ys)
                        (ref_loss / g).backward()
                    ref_opt.step()
                assert torch.equal(out, eager_out) and torch.equal(loss, eager_loss)
                torch.testing.assert_close(out, ref_out.detach(), rtol=1e-3, atol=1e-3)
                torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-3, atol=1e-3)
    finally:
        poptorch.setLogLevel("WARN")
    lines = _decisions(caplog)
    assert len(lines) == 1, lines
    assert pop._program.selector.trial is None and pop.backendInUse in ("compiled", "eager")
    assert {True, False} <= set(paths)  # both paths really ran during the trial
    eager_opt = eager._optimizer
    for (name, p), e, r in zip(model.named_parameters(), eager_model.parameters(),
                               ref.parameters(), strict=False):
        assert torch.equal(p, e), name
        torch.testing.assert_close(p, r, rtol=1e-3, atol=1e-3, msg=name)
        assert torch.equal(pop._optimizer.state[p]["momentum_buffer"],
                           eager_opt.state[e]["momentum_buffer"]), name
    assert torch.equal(model.bn.running_mean, eager_model.bn.running_mean)
    torch.testing.assert_close(model.bn.running_mean, ref.bn.running_mean, rtol=1e-3,
                               atol=1e-4)  # (the per-micro-batch means, 24 steps)


@pytest.mark.parametrize("compiled_faster", [True, False])
def test_training_trial_keeps_the_faster_path(automatic, compiled_faster):
    torch.manual_seed(2)
    model = Net()
    ref = copy.deepcopy(model)
    pop = poptorch.trainingModel(model, _opts(), torch.optim.SGD(model.parameters(), lr=0.1))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    x, y = torch.randn(4, 6), torch.randint(0, 3, (4,))

    def ref_step():
        ref_opt.zero_grad()
        out, loss = ref(x, y)
        loss.backward()
        ref_opt.step()
        return out.detach()
    pop(x, y)  # the eager first call: the trial starts
    ref_step()
    settle_trial(pop, compiled_faster)
    assert compiled_running(pop) == compiled_faster
    for _ in range(3):
        out, _ = pop(x, y)
        torch.testing.assert_close(out, ref_step(), rtol=1e-5, atol=1e-5)


class _Decisions:
    """What a BackendTrial tells its selector."""

    def __init__(self):
        self.ratio = self.band = None

    def __call__(self, ratio, band, processes):
        self.ratio, self.band = ratio, band


def _trial():
    decisions = _Decisions()
    return BackendTrial(decisions), decisions


def _feed(trial, compiled_times, eager_times):
    """Alternate calls as the selector does, recording the given times (skipped ones
    first); returns how many calls the trial took to decide."""
    calls = 0
    compiled_times, eager_times = iter(compiled_times), iter(eager_times)
    while trial.decide.ratio is None:
        use = trial.next_turn()
        trial.record(use, next(compiled_times if use else eager_times))
        calls += 1
    return calls


@pytest.mark.parametrize("compiled_faster", [True, False])
def test_trial_decides_after_one_round_when_the_paths_differ_clearly(compiled_faster):
    trial, decisions = _trial()
    fast, slow = [1.0] * 40, [1.2] * 40
    calls = _feed(trial, fast if compiled_faster else slow, slow if compiled_faster else fast)
    assert calls == 2 * (trial.SKIP + trial.CALLS)
    assert (decisions.ratio < 1.0 - decisions.band) == compiled_faster


def test_trial_measures_more_when_close_and_decides_on_all_calls():
    """Paths within the band of each other: more rounds are timed and the pairs of all
    rounds decide; a tie that stays close is decided after MAX_ROUNDS."""
    trial, decisions = _trial()
    per_round = trial.CALLS
    # first round: the compiled program 1% faster (within the band); from the second
    # round on the eager loop 20% faster, which tips the median of all pairs
    compiled_times = [9.0] + [0.99] * 40
    eager_times = [9.0] + [1.0] * per_round + [0.8] * 40
    calls = _feed(trial, compiled_times, eager_times)
    assert calls == 2 * (trial.SKIP + trial.MAX_ROUNDS * per_round)
    assert decisions.ratio > 1.0 + decisions.band  # the eager backend is faster

    trial, decisions = _trial()
    calls = _feed(trial, [9.0] + [0.99] * 80, [9.0] + [1.0] * 80)
    assert calls == 2 * (trial.SKIP + trial.MAX_ROUNDS * per_round)
    assert abs(decisions.ratio - 0.99) < 1e-9 and decisions.band >= BackendTrial.MIN_BAND


def test_the_band_is_the_spread_of_the_paired_ratios():
    """The same 5% advantage is outside the band of a steady measurement and inside the
    band of a noisy one (each pair's ratio 0.95 times 1 +- 30%)."""
    steady, decisions = _trial()
    _feed(steady, [9.0] + [0.95] * 40, [9.0] + [1.0] * 40)
    assert decisions.ratio == pytest.approx(0.95) and decisions.band < 0.05
    noisy, noisy_decisions = _trial()
    wobble = [1.3, 0.7, 1.25, 0.75, 1.3, 0.7] * 6
    _feed(noisy, [9.0] + [0.95 * w for w in wobble], [9.0] + [1.0] * 40)
    assert noisy_decisions.band > 0.05 + abs(noisy_decisions.ratio - 0.95)


def test_trial_is_not_decided_by_one_fast_outlier():
    """A path that is usually 10% slower but had one lucky call is not chosen (the
    minimum of each side would choose it; the median of paired ratios does not)."""
    trial, decisions = _trial()
    compiled_times = [9.0, 0.5] + [1.1] * 40
    calls = _feed(trial, compiled_times, [9.0] + [1.0] * 40)
    assert calls == 2 * (trial.SKIP + trial.CALLS)
    assert decisions.ratio > 1.0 + decisions.band


# ------------------------------------------------------------------ the kept decision
def _trained(d=1):
    torch.manual_seed(3)
    model = Net()
    return poptorch.trainingModel(model, _opts(d=d),
                                  torch.optim.SGD(model.parameters(), lr=0.1))


@pytest.mark.parametrize("compiled_faster", [True, False])
def test_the_trial_decision_is_kept_for_the_next_run(automatic, monkeypatch, tmp_path,
                                                     caplog, compiled_faster):
    """A second model of the same program on this machine (a rerun, a resumed run)
    takes the backend the first one's trial chose, without measuring, and gives the
    same numbers; another program measures for itself."""
    monkeypatch.setenv("POPTORCH_BACKEND_DECISIONS", str(tmp_path))
    x, y = torch.randn(4, 6), torch.randint(0, 3, (4,))
    first = _trained()
    assert first.backendInUse is None  # not compiled yet
    results = [first(x, y)]
    assert first.backendInUse == "trial"
    settle_trial(first, compiled_faster)
    assert len(list(tmp_path.iterdir())) == 1
    results += [first(x, y) for _ in range(4)]
    poptorch.setLogLevel("INFO")
    try:
        with caplog.at_level(logging.INFO, logger="poptorch"):
            again = _trained()
            for want in results:
                got = again(x, y)
                assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
                assert again._program.selector.trial is None
    finally:
        poptorch.setLogLevel("WARN")
    expected = "compiled" if compiled_faster else "eager"
    assert again.backendInUse in ((expected, "compiling") if compiled_faster else (expected,))
    assert any(f"backend {expected}, as an earlier run's trial decided" in r.getMessage()
               for r in caplog.records)
    other = _trained(d=2)  # another program: its own trial
    other(torch.randn(8, 6), torch.randint(0, 3, (8,)))
    assert other.backendInUse == "trial"


def test_a_saved_model_carries_its_backend(automatic, tmp_path):
    x, y = torch.randn(4, 6), torch.randint(0, 3, (4,))
    pop = _trained()
    pop(x, y)
    settle_trial(pop, compiled_faster=False)
    path = str(tmp_path / "model.poptorch")
    pop.save(path)
    loaded = poptorch.load(path)
    loaded(x, y)
    assert loaded.backendInUse == "eager" and loaded._program.selector.trial is None


# ------------------------------------------------------------------ steady state
def _stored(folder):
    files = list(folder.iterdir())
    assert len(files) == 1, files
    return json.loads(files[0].read_text())


@pytest.mark.parametrize("kept", ["compiled", "eager"])
def test_a_steady_state_check_corrects_a_close_choice(automatic, monkeypatch, tmp_path,
                                                      caplog, kept):
    """A close trial (compiled / eager 0.9, or 1 / 0.95) is checked again after
    CHECK_AFTER calls; when the check finds the other backend faster by more than its
    band, the model switches (one INFO line) and the store is told. Every call,
    before and after, matches plain PyTorch."""
    monkeypatch.setenv("POPTORCH_BACKEND_DECISIONS", str(tmp_path))
    monkeypatch.setattr(backend_trial, "CHECK_AFTER", 3)
    torch.manual_seed(4)
    model = Net()
    ref = copy.deepcopy(model)
    pop = poptorch.trainingModel(model, _opts(), torch.optim.SGD(model.parameters(), lr=0.1))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(8)

    def call():
        x, y = torch.randn(4, 6, generator=g), torch.randint(0, 3, (4,), generator=g)
        out, loss = pop(x, y)
        ref_opt.zero_grad()
        ref_out, ref_loss = ref(x, y)
        ref_loss.backward()
        ref_opt.step()
        torch.testing.assert_close(out, ref_out.detach(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-5, atol=1e-5)

    call()
    selector = settle_trial(pop, compiled_faster=kept == "compiled",
                            ratio=0.9 if kept == "compiled" else 0.95)
    assert _stored(tmp_path)["backend"] == kept
    assert selector.compiled is not None  # (a close call keeps it for the check)
    other = "eager" if kept == "compiled" else "compiled"
    # the check measures the other backend faster, well outside its band
    monkeypatch.setattr(BackendTrial, "ratio",
                        lambda self: (1.5, 0.02) if kept == "compiled" else (0.6, 0.02))
    poptorch.setLogLevel("INFO")
    ran = set()
    try:
        with caplog.at_level(logging.INFO, logger="poptorch"):
            for _ in range(3 + 2 * (BackendTrial.SKIP + BackendTrial.CALLS // 2 + 1)):
                assert pop.backendInUse == kept
                if selector.trial is not None:
                    ran.add(selector.trial._next)
                call()
            assert pop.backendInUse == other and selector.trial is None
            for _ in range(3):
                call()
    finally:
        poptorch.setLogLevel("WARN")
    assert ran == {True, False}  # the check ran both backends
    switches = [r.getMessage() for r in caplog.records if "steady-state check" in
                r.getMessage()]
    assert len(switches) == 1 and f"switching to the {other} backend" in switches[0]
    assert _stored(tmp_path)["backend"] == other
    for (name, p), r in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-5, msg=name)


def test_a_stored_decision_is_checked_and_one_from_elsewhere_ignored(automatic, monkeypatch,
                                                                    tmp_path):
    """A stored "compiled" skips the trial and is checked after CHECK_AFTER calls; a
    decision recorded on another machine or torch release is not used: the trial runs.
    The outputs are plain PyTorch's either way."""
    monkeypatch.setenv("POPTORCH_BACKEND_DECISIONS", str(tmp_path))
    monkeypatch.setattr(backend_trial, "CHECK_AFTER", 2)
    x, y = torch.randn(4, 6), torch.randint(0, 3, (4,))
    first = _trained()
    first(x, y)
    settle_trial(first, compiled_faster=True, ratio=0.5)  # clear: no check this run
    assert first._program.selector._calls_left == 0
    record = _stored(tmp_path)
    assert record["backend"] == "compiled" and record["machine"]["torch"] == torch.__version__

    def plain_outputs(calls):
        torch.manual_seed(3)
        ref = Net()
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
        outs = []
        for _ in range(calls):
            ref_opt.zero_grad()
            out, loss = ref(x, y)
            loss.backward()
            ref_opt.step()
            outs.append(out.detach())
        return outs

    again = _trained()
    selector = None
    checked = False
    for want in plain_outputs(10):
        out, _ = again(x, y)
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
        selector = again._program.selector
        assert selector.state is not TrialState.TRIAL
        checked |= selector.state is TrialState.COMPILED and selector.trial is not None
    assert checked  # the stored choice was measured again in steady state
    for field, value in (("torch", "1.0.0"), ("cpu", "another processor")):
        changed = dict(record, machine=dict(record["machine"], **{field: value}))
        (path,) = tmp_path.iterdir()
        path.write_text(json.dumps(changed))
        elsewhere = _trained()
        out, _ = elsewhere(x, y)
        torch.testing.assert_close(out, plain_outputs(1)[0], rtol=1e-5, atol=1e-5)
        assert elsewhere._program.selector._measure, field  # the trial runs again
        assert elsewhere.backendInUse == "trial"
