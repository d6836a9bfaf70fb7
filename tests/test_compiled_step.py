"""The compiled device program (``_runtime/compiled_step.py``) against plain PyTorch.

Most tests trace with torch.compile's ``aot_eager`` backend (the same whole-call capture
as inductor, eager kernels: seconds instead of a C++ build); one test runs inductor.
Every test also checks that the call really went through the compiled graph, so that a
silent fallback cannot make it pass.
"""
import copy
import logging

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import poptorch


@pytest.fixture(autouse=True)
def _aot_eager(monkeypatch):
    monkeypatch.setenv("POPTORCH_TORCH_COMPILE_BACKEND", "aot_eager")


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(6, 8)
        self.bn = nn.BatchNorm1d(8)
        self.fc2 = nn.Linear(8, 3)
        self.unused = nn.Linear(2, 2)  # never called: no gradient, never updated

    def forward(self, x, y):
        out = self.fc2(self.bn(F.relu(self.fc1(x))))
        return out, F.cross_entropy(out, y)


def _opts(d=1, g=1, backend="inductor"):
    opts = poptorch.Options().deviceIterations(d)
    opts.Training.gradientAccumulation(g)
    opts.showCompilationProgressBar(False)
    opts.Jit.backend(backend)
    return opts


def _compiled(pop):
    compiled = pop._program.compiled
    return compiled is not None and compiled._traced and not compiled.failed


def _reference_step(model, opt, x, y, g):
    """One plain-PyTorch optimizer step on the mean loss of g micro-batches."""
    opt.zero_grad()
    outs, losses = [], []
    for xs, ys in zip(x.chunk(g), y.chunk(g), strict=False):
        out, loss = model(xs, ys)
        (loss / g).backward()
        outs.append(out)
        losses.append(loss)
    opt.step()
    return outs[-1], losses[-1]


@pytest.mark.parametrize("d,g", [(1, 1), (3, 2)])
def test_training_matches_plain_pytorch(d, g):
    torch.manual_seed(1)
    model = Net()
    ref = copy.deepcopy(model)
    make_opt = lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9,  # noqa
                                         weight_decay=0.01)
    pop = poptorch.trainingModel(model, _opts(d, g), make_opt(model))
    ref_opt = make_opt(ref)
    for _call in range(3):  # call 0 runs eagerly, call 1 compiles, call 2 replays
        x, y = torch.randn(d * g * 4, 6), torch.randint(0, 3, (d * g * 4,))
        out, loss = pop(x, y)
        for i in range(d):
            rows = slice(i * g * 4, (i + 1) * g * 4)
            ref_out, ref_loss = _reference_step(ref, ref_opt, x[rows], y[rows], g)
        torch.testing.assert_close(out, ref_out.detach(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-5, atol=1e-5)
    assert _compiled(pop)
    for (name, p), r in zip(model.named_parameters(), ref.parameters(), strict=False):
        torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-5, msg=name)
    torch.testing.assert_close(model.bn.running_mean, ref.bn.running_mean)
    assert model.unused.weight.grad is None  # as in PyTorch: no gradient, no update


def test_inference_output_modes_match_plain_pytorch():
    torch.manual_seed(2)
    model = Net().eval()
    x, y = torch.randn(4 * 5, 6), torch.randint(0, 3, (4 * 5,))
    with torch.no_grad():
        want_out, want_loss = zip(*(model(xs, ys) for xs, ys in zip(x.chunk(4), y.chunk(4), strict=False)), strict=False)
    opts = _opts(d=4)
    pop = poptorch.inferenceModel(model, opts)
    for _ in range(2):  # the first call may run eagerly (precision rules learning)
        out, loss = pop(x, y)
        torch.testing.assert_close(out, torch.cat(want_out))
        torch.testing.assert_close(loss, torch.stack(want_loss))
    assert _compiled(pop)
    final = poptorch.inferenceModel(model, _opts(d=4).outputMode(poptorch.OutputMode.Final))
    for _ in range(2):
        out, loss = final(x, y)
        torch.testing.assert_close(out, want_out[-1])
    assert _compiled(final)


def test_host_weight_writes_zero_grad_and_set_optimizer_stay_correct():
    torch.manual_seed(3)
    model = Net()
    ref = copy.deepcopy(model)
    pop = poptorch.trainingModel(model, _opts(d=2),
                                 torch.optim.Adam(model.parameters(), lr=0.01))
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))

    def both():
        pop(x, y)
        for rows in (slice(0, 4), slice(4, 8)):
            _reference_step(ref, ref_opt, x[rows], y[rows], 1)

    both()
    both()
    assert _compiled(pop)
    with torch.no_grad():  # the user writes weights on the host
        model.fc1.weight.mul_(0.5)
        ref.fc1.weight.mul_(0.5)
    for p in model.parameters():  # and clears the gradients
        p.grad = None
    both()
    new_lr = torch.optim.Adam(model.parameters(), lr=0.002)
    new_lr.load_state_dict(pop._optimizer.state_dict())
    new_lr.param_groups[0]["lr"] = 0.002
    pop.setOptimizer(new_lr)
    for group in ref_opt.param_groups:
        group["lr"] = 0.002
    both()
    both()
    assert _compiled(pop)
    for (name, p), r in zip(model.named_parameters(), ref.parameters(), strict=False):
        torch.testing.assert_close(p, r, rtol=1e-4, atol=1e-5, msg=name)


class Branchy(nn.Module):
    """Data-dependent control flow: cannot be one graph."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        out = self.fc(x)
        if out.sum() > 0:
            return out * 2
        return out


def test_uncapturable_model_falls_back_with_one_info_line(caplog):
    torch.manual_seed(4)
    model = Branchy().eval()
    x = torch.randn(6, 4)
    with torch.no_grad():
        want = torch.cat([model(xs) for xs in x.chunk(3)])
    pop = poptorch.inferenceModel(model, _opts(d=3))
    poptorch.setLogLevel("INFO")
    try:
        with caplog.at_level(logging.INFO, logger="poptorch"):
            first = pop(x)
            second = pop(x)
    finally:
        poptorch.setLogLevel("WARN")
    torch.testing.assert_close(first, want)
    torch.testing.assert_close(second, want)
    assert pop._program.compiled.failed
    lines = [r.getMessage() for r in caplog.records if "falling back" in r.getMessage()]
    assert len(lines) == 1 and "cannot be compiled as one program" in lines[0]


def test_blocked_configuration_logs_why_and_uses_eager_loop(caplog):
    model = Net()
    opts = _opts()
    opts.anchorTensor("w", "fc1.weight")
    poptorch.setLogLevel("INFO")
    try:
        with caplog.at_level(logging.INFO, logger="poptorch"):
            pop = poptorch.trainingModel(model, opts,
                                         torch.optim.SGD(model.parameters(), lr=0.1))
            pop(torch.randn(4, 6), torch.randint(0, 3, (4,)))
    finally:
        poptorch.setLogLevel("WARN")
    assert pop._program.compiled is None
    assert any("anchored tensors" in r.getMessage() for r in caplog.records)


def test_inductor_training_matches_plain_pytorch(monkeypatch):
    """The real code generator, once: tiny model, one device iteration."""
    monkeypatch.setenv("POPTORCH_TORCH_COMPILE_BACKEND", "inductor")
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(4, 3))
    ref = copy.deepcopy(model)

    class WithLoss(nn.Module):
        def __init__(self, net):
            super().__init__()
            self.net = net

        def forward(self, x, y):
            out = self.net(x)
            return out, F.mse_loss(out, y)

    pop = poptorch.trainingModel(WithLoss(model), _opts(),
                                 torch.optim.SGD(model.parameters(), lr=0.1))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(3):
        x, y = torch.randn(5, 4), torch.randn(5, 3)
        _, loss = pop(x, y)
        ref_opt.zero_grad()
        ref_loss = F.mse_loss(ref(x), y)
        ref_loss.backward()
        ref_opt.step()
        torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-5, atol=1e-6)
    assert _compiled(pop)
    torch.testing.assert_close(model[0].weight, ref[0].weight, rtol=1e-5, atol=1e-6)


class TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 3), nn.Linear(4, 3)

    def forward(self, x, y):
        out = self.a(x) + self.b(x)
        return out, F.cross_entropy(out, y)


def test_retrace_that_would_differ_from_eager_falls_back_and_matches():
    """A parameter frozen between calls stops receiving gradients and must be skipped by
    the optimizer (grad=None, as in PyTorch), which the graph cannot express: its
    retrace gives up and the calls run eagerly with the same results."""
    torch.manual_seed(6)
    model = TwoHeads()
    ref = copy.deepcopy(model)
    pop = poptorch.trainingModel(model, _opts(d=2), torch.optim.SGD(
        model.parameters(), lr=0.1, momentum=0.9))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    for call in range(4):
        if call == 2:
            for frozen in (model.b, ref.b):
                frozen.weight.requires_grad_(False)
        pop(x, y)
        assert _compiled(pop) == (call == 1)
        for rows in (slice(0, 4), slice(4, 8)):
            ref_opt.zero_grad()
            ref(x[rows], y[rows])[1].backward()
            ref_opt.step()
    assert pop._program.compiled.failed
    for p, r in zip(model.parameters(), ref.parameters(), strict=False):
        torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-6)


class _Scale(nn.Module):
    def __init__(self):
        super().__init__()
        self.value = 1.0

    def forward(self, x):
        return x * self.value


class Scaled(nn.Module):
    """A model whose forward reads a Python number (on a submodule, which the wrapper
    shares with the user's model): changing it makes dynamo trace the step again (a
    guard on the value fails)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.scale = _Scale()

    def forward(self, x, y):
        out = self.scale(self.fc(x))
        return out, F.cross_entropy(out, y)


def test_retrace_after_a_guard_fails_stays_compiled_and_matches():
    """The settings of our capture are scoped to the trace; a later retrace (here: a
    number the forward reads changed) must get them too instead of giving up on the
    compiled program, and the weights still follow plain PyTorch."""
    torch.manual_seed(7)
    model = Scaled()
    ref = copy.deepcopy(model)
    pop = poptorch.trainingModel(model, _opts(d=2), torch.optim.SGD(
        model.parameters(), lr=0.1, momentum=0.9))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    for call in range(5):
        if call == 3:
            model.scale.value = ref.scale.value = 0.5
        pop(x, y)
        for rows in (slice(0, 4), slice(4, 8)):
            ref_opt.zero_grad()
            ref(x[rows], y[rows])[1].backward()
            ref_opt.step()
    assert _compiled(pop)
    for p, r in zip(model.parameters(), ref.parameters(), strict=False):
        torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-6)
