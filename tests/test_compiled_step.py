"""The compiled backend (``_runtime/program/compiled_step.py``) against plain PyTorch.

Most tests trace with torch.compile's ``aot_eager`` backend (the same capture as
inductor, eager kernels: seconds instead of a C++ build); one test runs inductor. Every
test also checks that the calls really ran the compiled pieces (dynamo's frame counter
moved, the backend in use is the compiled one), so that a silent fallback cannot make
it pass.
"""
import copy
import logging
import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import poptorch
from _backend_trial import compiled_running, training_runner  # noqa: E402


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
    return compiled_running(pop) and _frames() > 0


def _frames():
    """Frames dynamo has compiled in this process so far."""
    from torch._dynamo.utils import counters
    return counters["frames"]["ok"]


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
    assert training_runner(pop).split_reason is None  # forward + backward: one graph
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
    """Data-dependent control flow: not one graph (dynamo splits it at the branch)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        out = self.fc(x)
        if out.sum() > 0:
            return out * 2
        return out


def test_data_dependent_control_flow_stays_compiled_and_matches():
    """The forward is compiled in pieces around the branch (torch.compile's graph
    break), every call follows the branch its data takes."""
    torch.manual_seed(4)
    model = Branchy().eval()
    x = torch.randn(6, 4)
    with torch.no_grad():
        want = torch.cat([model(xs) for xs in x.chunk(3)])
    pop = poptorch.inferenceModel(model, _opts(d=3))
    for _ in range(4):
        torch.testing.assert_close(pop(x), want)
    assert _compiled(pop)


class BranchyLoss(nn.Module):
    """A training model with data-dependent control flow in its forward pass."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x, y):
        out = self.fc(x)
        if out.sum() > 0:
            out = out * 2
        return out, F.cross_entropy(out, y)


def test_a_micro_batch_that_cannot_be_one_graph_is_split_and_matches(caplog):
    """A graph break in the forward pass: the micro-batch cannot be traced with its
    backward as one graph, so the runner switches (one INFO line, before anything ran)
    to the compiled forward with autograd's backward; every step equals plain
    PyTorch's, with g=2 and d=2."""
    torch.manual_seed(6)
    model = BranchyLoss()
    ref = copy.deepcopy(model)
    pop = poptorch.trainingModel(model, _opts(d=2, g=2),
                                 torch.optim.SGD(model.parameters(), lr=0.1))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    poptorch.setLogLevel("INFO")
    try:
        with caplog.at_level(logging.INFO, logger="poptorch"):
            for _call in range(4):
                x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
                out, _ = pop(x, y)
                for rows in (slice(0, 8), slice(8, 16)):
                    ref_out, _ = _reference_step(ref, ref_opt, x[rows], y[rows], 2)
                torch.testing.assert_close(out, ref_out.detach(), rtol=1e-5, atol=1e-5)
    finally:
        poptorch.setLogLevel("WARN")
    assert _compiled(pop)
    assert training_runner(pop).split_reason is not None
    lines = [r for r in caplog.records if "cannot be one graph" in r.getMessage()]
    assert len(lines) == 1, [r.getMessage() for r in caplog.records]
    for p, r in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-5)


def test_anchored_tensors_are_read_after_compiled_steps():
    """Anchors are read between device iterations by the device loop, around the
    compiled pieces: the anchored gradient is the last step's, as eagerly."""
    torch.manual_seed(8)
    model = Net()
    ref = copy.deepcopy(model)
    opts = _opts(d=2)
    opts.anchorTensor("grad_w", "Gradient___fc1.weight")
    pop = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.1))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
    for _ in range(4):
        pop(x, y)
        for rows in (slice(0, 4), slice(4, 8)):
            _reference_step(ref, ref_opt, x[rows], y[rows], 1)
        torch.testing.assert_close(pop.getAnchoredTensor("grad_w"), ref.fc1.weight.grad)
    assert _compiled(pop)


def test_blocked_configuration_logs_why_and_uses_the_eager_backend(caplog):
    model = Net()
    opts = _opts()
    opts.Precision.enableFloatingPointExceptions(True)
    opts.Precision.setPartialsType(torch.float16)
    poptorch.setLogLevel("INFO")
    try:
        with caplog.at_level(logging.INFO, logger="poptorch"):
            pop = poptorch.trainingModel(model, _profiled(opts),
                                         torch.optim.SGD(model.parameters(), lr=0.1))
            for _ in range(3):
                pop(torch.randn(4, 6), torch.randint(0, 3, (4,)))
    finally:
        poptorch.setLogLevel("WARN")
    assert pop.backendInUse == "eager" and pop._program.selector.compiled is None
    assert any("the eager backend runs every call" in r.getMessage()
               for r in caplog.records)


def _profiled(opts):
    import tempfile
    opts.enableProfiling(tempfile.mkdtemp())
    return opts


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


_OPTIMIZER_STEPS = """
import copy, torch, torch.nn as nn, torch.nn.functional as F, poptorch
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    def forward(self, x, y):
        out = self.net(x)
        return out, F.cross_entropy(out, y)
worst = 0.0
for name, seed in ((n, s) for n in ("Adam", "AdamW") for s in (0, 1)):
    torch.manual_seed(seed)
    model = Net()
    ref = copy.deepcopy(model)
    opts = poptorch.Options()
    opts.Jit.backend("inductor")
    optimizer = getattr(poptorch.optim, name)
    pop = poptorch.trainingModel(model, opts, optimizer(model.parameters(), lr=1e-3))
    ref_opt = optimizer(ref.parameters(), lr=1e-3)
    x, y = torch.randn(4, 6), torch.randint(0, 3, (4,))
    for _ in range(5):
        pop(x, y)
        ref_opt.zero_grad()
        ref(x, y)[1].backward()
        ref_opt.step()
    assert pop.backendInUse == "compiled", pop.backendInUse
    worst = max([worst] + [(p - r).abs().max().item()
                           for p, r in zip(model.parameters(), ref.parameters())])
print(worst)
"""


@pytest.mark.slow
def test_inductor_update_of_poptorch_optimizers_counts_each_step(tmp_path):
    """poptorch.optim's Adam and AdamW read their step count in the update: it is traced
    as a graph value, so each compiled step equals the eager optimizer's, also in a
    second process that loads the compiled update from inductor's on-disk cache. (With
    the count read by ``.item()``, the graph after that break took it as a float input,
    and the cached graph a later process loaded used a stale count: 8e-4 off after five
    steps.) Adam and AdamW in one process each time: the processes' start is most of
    the cost."""
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"),
               POPTORCH_LOG_LEVEL="WARN", POPTORCH_BACKEND_DECISIONS="off",
               POPTORCH_TORCH_COMPILE_BACKEND="inductor")
    for process in ("compiles", "loads from the cache"):
        run = subprocess.run([sys.executable, "-c", _OPTIMIZER_STEPS],
                             env=env, capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stderr[-3000:]
        worst = float(run.stdout.strip().splitlines()[-1])
        assert worst <= 1e-6, (process, worst)


class TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 3), nn.Linear(4, 3)

    def forward(self, x, y):
        out = self.a(x) + self.b(x)
        return out, F.cross_entropy(out, y)


def test_a_parameter_frozen_between_calls_is_skipped_as_in_pytorch():
    """A parameter frozen between calls stops receiving gradients and is skipped by the
    optimizer (grad=None, as in PyTorch): the compiled micro-batch compiles again for
    it, its backward leaves that gradient None, and the update skips it."""
    torch.manual_seed(6)
    model = TwoHeads()
    ref = copy.deepcopy(model)
    pop = poptorch.trainingModel(model, _opts(d=2), torch.optim.SGD(
        model.parameters(), lr=0.1, momentum=0.9))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    for call in range(5):
        if call == 2:
            for frozen in (model.b, ref.b):
                frozen.weight.requires_grad_(False)
        pop(x, y)
        for rows in (slice(0, 4), slice(4, 8)):
            ref_opt.zero_grad()
            ref(x[rows], y[rows])[1].backward()
            ref_opt.step()
    assert _compiled(pop)
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
    """A number the forward reads changed: dynamo compiles the micro-batch again (a
    guard on the value fails) and the weights still follow plain PyTorch."""
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
