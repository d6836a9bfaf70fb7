"""Every failure of the compiled backend falls back to eager once, atomically
(``_runtime/program/fallback.py``).

Each stage's failure is injected through a torch.compile backend of the test's own
(``POPTORCH_TORCH_COMPILE_BACKEND`` names it; dynamo calls it exactly where it calls
inductor): its code generation raises, its compiled code raises, returns non-finite
values, or compiles too slowly; a capture failure comes from a model whose loss a
trace cannot choose. The same calls run on a model with the eager backend: every
output, weight, buffer and momentum buffer must be bitwise equal to its (the failed
attempt is undone, the step run again eagerly), and one WARNING names the stage.
"""
import copy
import logging
import time

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import poptorch

_FAILURES = {"calls": 0, "fail_at": 1}


def _register_backends():
    from torch._dynamo import register_backend
    from torch._dynamo.backends.registry import list_backends

    if "poptorch_test_codegen_fails" in list_backends(exclude_tags=()):
        return

    @register_backend
    def poptorch_test_codegen_fails(gm, example_inputs):
        raise RuntimeError("injected code generation failure")

    @register_backend
    def poptorch_test_run_fails(gm, example_inputs):
        def run(*args):
            _FAILURES["calls"] += 1
            if _FAILURES["calls"] >= _FAILURES["fail_at"]:
                raise UnboundLocalError("cannot access local variable 'arg33_1' where it "
                                        "is not associated with a value")
            return gm.forward(*args)
        return run

    @register_backend
    def poptorch_test_nan(gm, example_inputs):
        def run(*args):
            outs = gm.forward(*args)
            return type(outs)(o * float("nan") if isinstance(o, torch.Tensor)
                              and o.is_floating_point() else o for o in outs)
        return run

    @register_backend
    def poptorch_test_slow(gm, example_inputs):
        time.sleep(0.4)
        return gm.forward


_register_backends()


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(6, 8)
        self.bn = nn.BatchNorm1d(8)
        self.drop = nn.Dropout(0.25)
        self.fc2 = nn.Linear(8, 3)

    def forward(self, x, y):
        out = self.fc2(self.drop(self.bn(F.relu(self.fc1(x)))))
        return out, F.cross_entropy(out, y)


class TwoLosses(Net):
    """Two returned identity_loss values: which one is final needs the autograd
    graph, which a trace cannot read (a capture failure)."""

    def forward(self, x, y):
        out, loss = super().forward(x, y)
        return (out, poptorch.identity_loss(loss, reduction="mean"),
                poptorch.identity_loss(out.pow(2).mean(), reduction="mean"))


def _opts(backend, d=2, g=2):
    opts = poptorch.Options().deviceIterations(d)
    opts.Training.gradientAccumulation(g)
    opts.showCompilationProgressBar(False)
    opts.randomSeed(11)
    opts.Jit.backend(backend)
    return opts


def _pair(model_class, backend):
    torch.manual_seed(0)
    model = model_class()
    eager_model = copy.deepcopy(model)

    def make(m, b):
        return poptorch.trainingModel(m, _opts(b), torch.optim.SGD(
            m.parameters(), lr=0.05, momentum=0.9))
    return model, make(model, backend), eager_model, make(eager_model, "eager")


def _run_and_compare(model_class, monkeypatch, caplog, compile_backend, backend="inductor",
                     calls=5, training=True):
    monkeypatch.setenv("POPTORCH_TORCH_COMPILE_BACKEND", compile_backend)
    model, pop, eager_model, eager = _pair(model_class, backend)
    g = torch.Generator().manual_seed(5)
    with caplog.at_level(logging.WARNING, logger="poptorch"):
        for _ in range(calls):
            x, y = torch.randn(16, 6, generator=g), torch.randint(0, 3, (16,), generator=g)
            got, want = pop(x, y), eager(x, y)
            for a, b in zip(got, want, strict=True):
                assert torch.equal(a, b)
    for (name, p), e in zip(model.named_parameters(), eager_model.parameters(),
                            strict=True):
        assert torch.equal(p, e), name
        assert torch.equal(pop._optimizer.state[p]["momentum_buffer"],
                           eager._optimizer.state[e]["momentum_buffer"]), name
    for (name, b), e in zip(model.named_buffers(), eager_model.buffers(), strict=True):
        assert torch.equal(b, e), name
    assert pop.backendInUse == "eager" and pop._program.selector.compiled is None
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING
                and "compiled backend failed" in r.getMessage()]
    assert len(warnings) == 1, warnings
    return warnings[0]


def test_capture_failure_falls_back(monkeypatch, caplog):
    warning = _run_and_compare(TwoLosses, monkeypatch, caplog, "aot_eager")
    assert "(capture: Uncapturable" in warning


def test_code_generation_failure_falls_back(monkeypatch, caplog):
    warning = _run_and_compare(Net, monkeypatch, caplog, "poptorch_test_codegen_fails")
    assert "(code generation: BackendCompilerFailed" in warning
    assert "injected code generation failure" in warning


@pytest.mark.parametrize("fail_at", [1, 3])
def test_an_error_out_of_compiled_code_falls_back(monkeypatch, caplog, fail_at):
    """The compiled code raises at its first run (the micro-batch's), or at a later one
    of the first calls (the third run of compiled code: the compiled update's first)."""
    monkeypatch.setitem(_FAILURES, "calls", 0)
    monkeypatch.setitem(_FAILURES, "fail_at", fail_at)
    warning = _run_and_compare(Net, monkeypatch, caplog, "poptorch_test_run_fails")
    stage = "(run:" if fail_at == 1 else "(update run:"
    assert f"{stage} UnboundLocalError: cannot access local variable 'arg33_1'" in warning


def test_non_finite_compiled_results_fall_back(monkeypatch, caplog):
    warning = _run_and_compare(Net, monkeypatch, caplog, "poptorch_test_nan")
    assert "(result check:" in warning and "not finite" in warning


def test_compile_over_budget_falls_back(monkeypatch, caplog):
    monkeypatch.setenv("POPTORCH_COMPILE_BUDGET", "0.2")
    warning = _run_and_compare(Net, monkeypatch, caplog, "poptorch_test_slow")
    assert "(compile budget: the compiles took" in warning


def test_the_automatic_backend_falls_back_too(monkeypatch, caplog):
    """During the trial (the ``fastest`` backend) a failing compiled call is undone and
    run again eagerly as well: the trial ends, the eager backend stays."""
    warning = _run_and_compare(Net, monkeypatch, caplog, "poptorch_test_codegen_fails",
                               backend="fastest")
    assert "code generation" in warning
    # the failure decided, not the trial's timings
    assert not any("the compiled backend takes" in r.getMessage() for r in caplog.records)


def test_inference_falls_back(monkeypatch, caplog):
    monkeypatch.setenv("POPTORCH_TORCH_COMPILE_BACKEND", "poptorch_test_nan")
    torch.manual_seed(0)
    model = Net().eval()
    opts = poptorch.Options().deviceIterations(3)
    opts.showCompilationProgressBar(False)
    opts.Jit.backend("inductor")
    pop = poptorch.inferenceModel(model, opts)
    x, y = torch.randn(12, 6), torch.randint(0, 3, (12,))
    with torch.no_grad():
        want = [model(a, b) for a, b in zip(x.chunk(3), y.chunk(3), strict=True)]
    with caplog.at_level(logging.WARNING, logger="poptorch"):
        for _ in range(4):
            out, loss = pop(x, y)
            assert torch.equal(out, torch.cat([w[0] for w in want]))
            assert torch.equal(loss, torch.stack([w[1] for w in want]))
    assert pop.backendInUse == "eager"
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "result check" in warnings[0].getMessage()


def test_genuinely_non_finite_results_keep_the_compiled_backend(monkeypatch, caplog):
    """A result that is not finite eagerly either (here: an input holding inf) is the
    model's, not the compiler's: no fallback, and the outputs are eager's."""
    monkeypatch.setenv("POPTORCH_TORCH_COMPILE_BACKEND", "aot_eager")
    model = Net().eval()
    opts = poptorch.Options()
    opts.showCompilationProgressBar(False)
    opts.Jit.backend("inductor")
    pop = poptorch.inferenceModel(model, opts)
    x, y = torch.randn(4, 6), torch.randint(0, 3, (4,))
    x[0, 0] = float("inf")
    with caplog.at_level(logging.WARNING, logger="poptorch"):
        for _ in range(3):
            out, _loss = pop(x, y)
            with torch.no_grad():
                want = model(x, y)[0]
            torch.testing.assert_close(out, want, rtol=0, atol=0, equal_nan=True)
    assert pop._program.selector.compiled is not None
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]


class RejectsBadSamples(nn.Module):
    """A model that raises its own error on a bad input (as data validation does)."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(6, 8)
        self.bn = nn.BatchNorm1d(8)
        self.fc2 = nn.Linear(8, 3)

    def forward(self, x, y):
        if bool((x.abs() > 1e3).any()):
            raise ValueError("c19: bad sample in this micro-batch")
        out = self.fc2(self.bn(F.relu(self.fc1(x))))
        return out, F.cross_entropy(out, y)


@pytest.mark.parametrize("when", ["probation", "trial", "compiled"])
def test_an_error_the_eager_rerun_raises_too_is_the_users(monkeypatch, tmp_path, caplog,
                                                          when):
    """The model's forward raises a ValueError on one input at a compiled call (the
    first, guarded one; one timed by the trial; one once the compiled backend is
    kept): the caller gets plain PyTorch's exception (class and message), the model
    keeps its backend, no decision is stored, and the next calls match plain PyTorch
    trained on the good inputs only."""
    from _backend_trial import settle_trial

    from poptorch._runtime.program.backend_trial import TrialState

    monkeypatch.delenv("POPTORCH_BACKEND", raising=False)  # the automatic backend
    monkeypatch.setenv("POPTORCH_TORCH_COMPILE_BACKEND", "aot_eager")
    monkeypatch.setenv("POPTORCH_BACKEND_DECISIONS", str(tmp_path))
    torch.manual_seed(0)
    model = RejectsBadSamples()
    ref = copy.deepcopy(model)
    opts = poptorch.Options()
    opts.showCompilationProgressBar(False)
    pop = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.1))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(7)

    def batch():
        return torch.randn(4, 6, generator=g), torch.randint(0, 3, (4,), generator=g)

    def good_call():
        x, y = batch()
        out, loss = pop(x, y)
        ref_opt.zero_grad()
        ref_out, ref_loss = ref(x, y)
        ref_loss.backward()
        ref_opt.step()
        torch.testing.assert_close(out, ref_out.detach(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-5, atol=1e-5)

    good_call()  # eager, timed: the compiled backend's probation comes next
    selector = pop._program.selector
    if when == "trial":
        while selector.state is not TrialState.TRIAL:
            good_call()
        good_call()  # the trial's first call is an eager one
        assert selector.trial._next is True  # the coming call: a compiled one
    elif when == "compiled":
        settle_trial(pop, compiled_faster=True)
        good_call()
    stored = sorted(p.read_text() for p in tmp_path.iterdir())
    state = selector.state
    assert state is {"probation": TrialState.COMPILING, "trial": TrialState.TRIAL,
                     "compiled": TrialState.COMPILED}[when]
    x, y = batch()
    x[2, 1] = 1e4
    with pytest.raises(ValueError) as plain:
        ref(x, y)
    with caplog.at_level(logging.WARNING, logger="poptorch"), \
            pytest.raises(ValueError) as raised:
        pop(x, y)
    assert type(raised.value) is type(plain.value)
    assert str(raised.value) == str(plain.value)
    assert selector.state is state and selector.compiled is not None
    assert sorted(p.read_text() for p in tmp_path.iterdir()) == stored
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING
                and r.name.startswith("poptorch")]  # (no fallback warning)
    for _ in range(3):
        good_call()
    for (name, p), r in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-5, msg=name)
    torch.testing.assert_close(model.bn.running_mean, ref.bn.running_mean)
