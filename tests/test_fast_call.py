"""The per-call fast path (``executor/program_call.py``) and the ``fastest`` backend's
choice (``backend_trial.BackendTrial``), against plain PyTorch.

Every test first checks that its calls really take the fast path (``_compiled.calls.fast``
is built),
so that a silent fall back to the general path cannot make it pass.
"""
import copy
import logging

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import poptorch
from poptorch.executor.program_call import ProgramCall
from _backend_trial import settle_trial  # noqa: E402


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(6, 8)
        self.fc2 = nn.Linear(8, 3)

    def forward(self, x, y):
        out = self.fc2(F.relu(self.fc1(x)))
        return out, F.cross_entropy(out, y)


def _opts(backend="eager", d=1):
    opts = poptorch.Options().deviceIterations(d)
    opts.showCompilationProgressBar(False)
    opts.Jit.backend(backend)
    return opts


def _data(n=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)


def _warm(pop, x, y, calls=3):
    for _ in range(calls):
        pop(x, y)
    assert pop._compiled.calls.fast, "the fast path was not built"


def test_inference_fast_path_matches_plain_pytorch_and_sees_host_weight_writes():
    model = Net()  # in train mode: the wrapper runs it in eval mode, then restores
    ref = copy.deepcopy(model).eval()
    pop = poptorch.inferenceModel(model, _opts())
    x, y = _data()
    _warm(pop, x, y)
    for step in range(3):
        with torch.no_grad():
            model.fc1.weight.add_(0.5)  # host writes, in place and by assignment
            ref.fc1.weight.add_(0.5)
            if step == 1:
                model.fc2.bias = nn.Parameter(torch.full((3,), 2.0))
                ref.fc2.bias = nn.Parameter(torch.full((3,), 2.0))
            want_out, want_loss = ref(x, y)
        out, loss = pop(x, y)
        assert torch.equal(out, want_out) and torch.equal(loss, want_loss)
        assert not out.requires_grad and not loss.requires_grad
    assert model.training and all(m.training for m in model.modules())


def test_fast_path_keeps_input_errors_and_the_general_path_cases():
    model = Net().eval()
    pop = poptorch.inferenceModel(model, _opts())
    x, y = _data()
    _warm(pop, x, y)
    with pytest.raises(poptorch.Error) as info:
        pop(torch.randn(5, 6), y)
    text = str(info.value)
    assert "Shape mismatch for x" in text and "compiled for the inputs" in text
    assert "called with" in text
    with pytest.raises(poptorch.Error, match="Dtype mismatch for y"):
        pop(x, y.to(torch.int32))
    with torch.no_grad():
        want = model(x, y)
    # by keyword, and with an input that requires grad: the general path, same results
    out = pop(x=x, y=y)
    assert torch.equal(out[0], want[0])
    out = pop(x.clone().requires_grad_(), y)
    assert torch.equal(out[0], want[0]) and not out[0].requires_grad
    # a non-contiguous view, a Parameter and a tensor subclass of the compiled shape:
    # the fast path's input check sends them the general way, same results
    strided = torch.stack([x, x], dim=2)[..., 0]
    assert not strided.is_contiguous() and torch.equal(strided, x)
    assert torch.equal(pop(strided, y)[0], want[0])
    assert torch.equal(pop(nn.Parameter(x.clone(), requires_grad=False), y)[0], want[0])

    class Marked(torch.Tensor):
        pass
    out = pop(x.as_subclass(Marked), y)
    assert torch.equal(out[0], want[0])
    assert pop._compiled.calls.fast  # still there for the next plain call
    assert torch.equal(pop(x, y)[1], want[1])


def test_fast_path_state_running_on_ipu_marks_constants_and_perf_counters():
    seen = []

    class Stateful(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(6, 3)
            self.offset = torch.zeros(3)  # a plain tensor attribute: a constant
            self.drop = nn.Dropout(0.5)

        def forward(self, x, y):
            seen.append((poptorch.isRunningOnIpu(), self.training, self.drop.training))
            out = self.drop(self.fc(x)) + self.offset
            self.offset.add_(1.0)  # changed in place: the next call starts from zero
            return poptorch.identity_loss(out.sum(), reduction="none")

    model = Stateful()
    ref = copy.deepcopy(model).eval()
    pop = poptorch.inferenceModel(model, _opts())
    x, y = _data()
    _warm(pop, x, y)
    for _ in range(2):
        with torch.no_grad():
            want = ref.fc(x).sum()
        assert torch.equal(pop(x, y), want)
    assert seen[-1] == (True, False, False) and model.training and model.drop.training
    assert not poptorch.isRunningOnIpu()
    from poptorch._runtime import context
    assert context.take_marked_losses() == []  # the inference marks were dropped
    counters = pop.getPerfCounters()
    assert [len(v) for v in counters["input"]] == [1, 1]
    assert counters["input"][0][0] <= counters["output"][0][0]
    assert pop.getComputeLatency()[0] >= 0.0


def test_training_fast_path_matches_plain_pytorch_loop():
    torch.manual_seed(1)
    model = Net()
    ref = copy.deepcopy(model)
    pop = poptorch.trainingModel(model, _opts(),
                                 torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for call in range(6):
        x, y = _data(seed=call)
        out, loss = pop(x, y)
        ref_opt.zero_grad()
        ref_out, ref_loss = ref(x, y)
        ref_loss.backward()
        ref_opt.step()
        assert torch.equal(out, ref_out.detach()) and torch.equal(loss, ref_loss.detach())
        if call == 3:  # a new learning rate: the fast path is rebuilt with its sync
            pop.setOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
            for group in ref_opt.param_groups:
                group["lr"] = 0.05
    assert isinstance(pop._compiled.calls.fast, ProgramCall)
    for p, r in zip(model.parameters(), ref.parameters(), strict=False):
        assert torch.equal(p, r)


def test_training_calls_under_no_grad_after_the_fast_path_still_train():
    """``__call__`` tries the fast path first; a training call made under
    ``torch.no_grad()`` / ``torch.inference_mode()`` must still take the general path's
    grad re-entry and train as the plain loop does."""
    torch.manual_seed(2)
    model = Net()
    ref = copy.deepcopy(model)
    pop = poptorch.trainingModel(model, _opts(), torch.optim.SGD(model.parameters(), lr=0.1))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    scopes = [torch.enable_grad, torch.enable_grad, torch.enable_grad, torch.no_grad,
              torch.inference_mode, torch.enable_grad]
    for call, scope in enumerate(scopes):
        x, y = _data(seed=call)
        with scope():
            out, loss = pop(x, y)
        if call == 2:
            assert isinstance(pop._compiled.calls.fast, ProgramCall)
        ref_opt.zero_grad()
        ref_out, ref_loss = ref(x, y)
        ref_loss.backward()
        ref_opt.step()
        assert torch.equal(out, ref_out.detach()) and torch.equal(loss, ref_loss.detach())
    for p, r in zip(model.parameters(), ref.parameters(), strict=False):
        assert torch.equal(p, r)


def test_fast_path_follows_destroy_and_detach():
    model = Net().eval()
    pop = poptorch.inferenceModel(model, _opts())
    x, y = _data()
    _warm(pop, x, y)
    pop.detachFromDevice()
    with torch.no_grad():
        want = model(x, y)
    assert torch.equal(pop(x, y)[0], want[0]) and pop.isAttachedToDevice()
    pop.destroy()
    assert pop._compiled is None  # the compilation and its fast path are gone
    x8, y8 = _data(8)
    with torch.no_grad():
        want8 = model(x8, y8)
    _warm(pop, x8, y8)  # compiled again for the new shape
    assert torch.equal(pop(x8, y8)[0], want8[0])


def test_rng_state_set_after_the_fast_path_is_built_is_used():
    class Noisy(nn.Module):
        def forward(self, x):
            return x + torch.rand_like(x)

    pop = poptorch.inferenceModel(Noisy(), _opts())
    x = torch.zeros(2, 3)
    for _ in range(3):
        pop(x)
    assert pop._compiled.calls.fast
    pop.rng_state = [7, torch.Generator().manual_seed(7).get_state()]
    host = torch.get_rng_state()
    want = torch.rand(4, 3, generator=torch.Generator().manual_seed(7))
    assert torch.equal(pop(x), want[:2]) and torch.equal(pop(x), want[2:])
    assert torch.equal(torch.get_rng_state(), host)  # the host's stream is left alone


def test_module_with_own_setattr_gets_its_mode_switched_and_restored():
    class Logged(nn.Linear):
        def __setattr__(self, name, value):
            if name == "training":
                self.__dict__.setdefault("switches", []).append(value)
            super().__setattr__(name, value)

    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = Logged(6, 3)

        def forward(self, x):
            assert not self.inner.training
            return self.inner(x)

    model = Outer()
    pop = poptorch.inferenceModel(model, _opts())
    x, _ = _data()
    for _ in range(4):
        with torch.no_grad():
            assert torch.equal(pop(x), model.inner(x))
    assert pop._compiled.calls.fast
    assert model.inner.training and model.inner.switches[-2:] == [False, True]


def test_float16_inputs_to_a_float32_model_keep_their_casting():
    model = Net().eval()
    pop = poptorch.inferenceModel(model, _opts())
    x, y = _data()
    half = x.half()
    for _ in range(4):
        out, _loss = pop(half, y)
        assert out.dtype == torch.float16  # weights follow the float16 activations
    assert not pop._compiled.calls.fast  # the casting rules cast: no fast path
    with torch.no_grad():
        want = model.half()(half, y)[0]
    torch.testing.assert_close(out, want)


# ------------------------------------------------------------------ the fastest backend

@pytest.fixture
def _aot_eager(monkeypatch):
    monkeypatch.setenv("POPTORCH_TORCH_COMPILE_BACKEND", "aot_eager")


@pytest.mark.parametrize("d", [1, 4])
def test_fastest_backend_chooses_once_and_matches_plain_pytorch(_aot_eager, caplog, d):
    model = Net().eval()
    x, y = _data(4 * d)
    with torch.no_grad():
        outs = [model(a, b) for a, b in zip(x.chunk(d), y.chunk(d), strict=False)]
    want_out = torch.cat([o[0] for o in outs])
    pop = poptorch.inferenceModel(model, _opts("fastest", d))
    poptorch.setLogLevel("INFO")
    try:
        with caplog.at_level(logging.INFO, logger="poptorch"):
            for _ in range(44):  # 2 warm-up calls, up to 38 of the trial, 4 after
                out, _loss = pop(x, y)
                torch.testing.assert_close(out, want_out, rtol=1e-6, atol=1e-6)
    finally:
        poptorch.setLogLevel("WARN")
    lines = [r.getMessage() for r in caplog.records if "eager backend" in
             r.getMessage() and "per call" in r.getMessage()]
    assert len(lines) == 1, lines
    kept = "keeping the compiled backend" in lines[0]
    assert pop.backendInUse == ("compiled" if kept else "eager")
    assert pop._program.selector.trial is None
    if d == 1:  # either backend's calls take the fast path once it is decided
        assert isinstance(pop._compiled.calls.fast, ProgramCall)


@pytest.mark.parametrize("compiled_faster", [True, False])
def test_backend_trial_keeps_the_faster_path(_aot_eager, compiled_faster):
    pop = poptorch.inferenceModel(Net().eval(), _opts("fastest"))
    x, y = _data()
    pop(x, y)  # the eager first call: the trial starts
    settle_trial(pop, compiled_faster)
    with torch.no_grad():
        want = pop.model(x, y)[0]
    torch.testing.assert_close(pop(x, y)[0], want, rtol=1e-6, atol=1e-6)


class RegionInside(nn.Module):
    """bmm in a poptorch.autocast region of its own forward: half precision."""

    def forward(self, x, y):
        with poptorch.autocast():
            return torch.bmm(x, y)


def test_fast_path_applies_a_region_inside_the_forward_and_one_around_the_call():
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(1, 4, 4, generator=g), torch.randn(1, 4, 4, generator=g)
    half_reference = torch.bmm(x.half(), y.half())
    pop = poptorch.inferenceModel(RegionInside(), _opts())
    _warm(pop, x, y)
    out = pop(x, y)  # on the fast path: the region still finds the model's run
    assert out.dtype == torch.float16 and torch.equal(out, half_reference)

    class Plain(nn.Module):
        def forward(self, x, y):
            return torch.bmm(x, y)
    plain = poptorch.inferenceModel(Plain(), _opts())
    _warm(plain, x, y)
    assert torch.equal(plain(x, y), torch.bmm(x, y))
    with poptorch.autocast():  # a region around a warmed-up model's call applies
        out = plain(x, y)
    assert out.dtype == torch.float16 and torch.equal(out, half_reference)
    assert torch.equal(plain(x, y), torch.bmm(x, y))  # and ends with it
    assert torch._C._len_torch_function_stack() == 0


def test_fast_path_of_a_model_called_inside_another_model():
    torch.manual_seed(0)
    inner_net = Net()
    x, y = _data()
    inner = poptorch.inferenceModel(copy.deepcopy(inner_net), _opts())
    _warm(inner, x, y)

    class Outer(nn.Module):
        def forward(self, x, y):
            out, loss = inner(x, y)  # a warmed-up model, called from another's forward
            return out * 2, loss

    outer = poptorch.inferenceModel(Outer(), _opts())
    for _ in range(3):
        out, loss = outer(x, y)
        ref_out, ref_loss = inner_net.eval()(x, y)
        torch.testing.assert_close(out, ref_out.detach() * 2, rtol=0, atol=0)
        torch.testing.assert_close(loss, ref_loss.detach(), rtol=0, atol=0)
    assert torch.equal(inner(x, y)[0], ref_out.detach())
