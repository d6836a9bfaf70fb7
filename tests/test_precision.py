"""Options().Precision applied by PrecisionPolicy (poptorch/_runtime/precision.py):
half/float casting, float32 running statistics, partials type, stochastic rounding of
the weight update and floating point exceptions, each against plain PyTorch.

The tests at the end (``test_e2e_*``) go through trainingModel/inferenceModel and need
the executor to use PrecisionPolicy."""
import logging

import pytest
import torch
import torch.nn.functional as F

import poptorch
from poptorch import _logging
from poptorch._runtime.weights.modelcopy import shallow_copy_module
from poptorch._runtime.numerics.precision import PrecisionPolicy, stochastic_round
from poptorch._runtime.config import PrecisionConfig

CPU = torch.device("cpu")
Cast = poptorch.HalfFloatCastingBehavior
FP16_ULP_AT_ONE = 2.0 ** -10


def policy(model=None, training=True, device=CPU, **precision):
    opts = poptorch.Options()
    setters = {"casting": opts.Precision.halfFloatCasting,
               "float_stats": opts.Precision.runningStatisticsAlwaysFloat,
               "partials": opts.Precision.setPartialsType,
               "sr": opts.Precision.enableStochasticRounding,
               "fpe": opts.Precision.enableFloatingPointExceptions}
    for key, value in precision.items():
        setters[key](value)
    return PrecisionPolicy(PrecisionConfig.of(opts.Precision),
                           model if model is not None else torch.nn.Linear(2, 2),
                           training, device)


def neighbours(x, dtype):
    """The two values of ``dtype`` around float32 ``x`` (computed with plain torch)."""
    low = x.to(dtype)
    low = torch.where(low.float() > x, torch.nextafter(low, torch.tensor(-float("inf"),
                                                                         dtype=dtype)), low)
    high = torch.nextafter(low, torch.tensor(float("inf"), dtype=dtype))
    return low.float(), high.float()


# --- default: nothing to do ----------------------------------------------------------
def test_default_policy_is_inactive_and_uses_torch_promotion():
    pol = policy()
    assert not pol.active and not pol.checks_finite
    a, b = torch.randn(5), torch.randn(5).half()
    with pol:
        out = a + b
        assert torch._C._len_torch_function_stack() == 0
    assert out.dtype == torch.float32 and torch.equal(out, a + b.float())


# --- halfFloatCasting ----------------------------------------------------------------
def test_float_downcast_to_half_matches_explicit_downcast():
    pol = policy(casting=Cast.FloatDowncastToHalf)
    assert pol.active
    a, b = torch.randn(6, 4), torch.randn(6, 4).half()
    w, bias = torch.randn(3, 4), torch.randn(3)
    with pol:
        added = a + b
        lin = F.linear(b, w, bias)
        cat = torch.cat([a, b])
        same = a * 2.0  # not mixed: untouched
    assert added.dtype == torch.float16 and torch.equal(added, a.half() + b)
    assert lin.dtype == torch.float16 and torch.equal(lin, F.linear(b, w.half(), bias.half()))
    assert torch.equal(cat, torch.cat([a.half(), b]))
    assert same.dtype == torch.float32 and torch.equal(same, a * 2.0)


def test_float_downcast_gradients_reach_float32_parameters():
    torch.manual_seed(1)
    layer = torch.nn.Linear(4, 3)
    ref = torch.nn.Linear(4, 3)
    ref.load_state_dict(layer.state_dict())
    x = torch.randn(5, 4).half()
    with policy(layer, casting=Cast.FloatDowncastToHalf):
        layer(x).float().pow(2).sum().backward()
    F.linear(x, ref.weight.half(), ref.bias.half()).float().pow(2).sum().backward()
    assert layer.weight.grad.dtype == torch.float32
    assert torch.equal(layer.weight.grad, ref.weight.grad)
    assert torch.equal(layer.bias.grad, ref.bias.grad)


def test_float_downcast_leaves_in_place_and_conversions_alone():
    a, b = torch.randn(4), torch.randn(4).half()
    expected = a.clone().add_(b)
    with policy(casting=Cast.FloatDowncastToHalf):
        c = a.clone()
        c.add_(b)
        converted = b.to(a.dtype)
        typed = b.type_as(a)
    assert c.dtype == torch.float32 and torch.equal(c, expected)
    assert converted.dtype == torch.float32 and typed.dtype == torch.float32


def test_half_upcast_to_float_equals_torch_promotion():
    a, b = torch.randn(6, 4), torch.randn(6, 4).half()
    w = torch.randn(3, 4)
    with policy(casting=Cast.HalfUpcastToFloat):
        added = a + b
        lin = F.linear(b, w)  # plain torch refuses mixed linear; upcast computes in float32
    assert added.dtype == torch.float32 and torch.equal(added, a + b)
    assert torch.equal(lin, F.linear(b.float(), w))


def test_casting_mode_ends_with_the_call():
    a, b = torch.randn(3), torch.randn(3).half()
    pol = policy(casting=Cast.FloatDowncastToHalf)
    with pol:
        assert torch._C._len_torch_function_stack() == 1
    assert torch._C._len_torch_function_stack() == 0
    assert (a + b).dtype == torch.float32
    with pytest.raises(ValueError):
        with pol:
            raise ValueError("boom")
    assert (a + b).dtype == torch.float32


# --- runningStatisticsAlwaysFloat ---------------------------------------------------
class BnNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(2, 3, 1)
        self.bn = torch.nn.BatchNorm2d(3, momentum=0.3)

    def forward(self, x):
        return self.bn(self.conv(x))


def test_running_statistics_kept_float_match_float32_batchnorm():
    torch.manual_seed(2)
    user = BnNet()
    with torch.no_grad():
        user.bn.weight.uniform_(0.5, 1.5)
        user.bn.bias.uniform_(-0.5, 0.5)
    user.half()
    ref = BnNet()
    ref.load_state_dict({k: v.float() for k, v in user.state_dict().items()})
    device_copy = shallow_copy_module(user)
    mean_obj = user.bn.running_mean
    pol = policy(device_copy)
    assert pol.float_statistics == ["bn"]
    assert user.bn.running_mean is mean_obj and mean_obj.dtype == torch.float32
    assert user.bn.running_var.dtype == torch.float32
    for step in range(3):
        x = (torch.randn(4, 2, 3, 3) * 3 + step).half()
        out = device_copy(x)
        conv = ref.conv(x.float()).half().float()  # the half conv's output, in float32
        expected = ref.bn(conv)
        assert out.dtype == torch.float16
        assert torch.equal(out, expected.half())
        out.float().sum().backward()
    assert torch.equal(user.bn.running_mean, ref.bn.running_mean)
    assert torch.equal(user.bn.running_var, ref.bn.running_var)
    assert user.bn.num_batches_tracked.item() == 3
    assert user.bn.weight.grad.dtype == torch.float16
    device_copy.eval()
    x = torch.randn(4, 2, 3, 3).half()
    ref.eval()
    assert torch.equal(device_copy(x), ref.bn(ref.conv(x.float()).half().float()).half())


def test_running_statistics_not_forced_float_when_disabled():
    bn = torch.nn.BatchNorm1d(3).half()
    ref = torch.nn.BatchNorm1d(3).half()
    pol = policy(bn, float_stats=False)
    assert pol.float_statistics == []
    x = torch.randn(8, 3).half()
    assert torch.equal(bn(x), ref(x))
    assert bn.running_mean.dtype == torch.float16
    assert torch.equal(bn.running_mean, ref.running_mean)


def test_float32_model_is_not_adapted():
    bn = torch.nn.BatchNorm1d(3)
    forward = bn.forward
    assert policy(bn).float_statistics == []
    assert bn.forward == forward


# --- setPartialsType -----------------------------------------------------------------
def test_partials_type_on_cpu_is_logged_once(caplog, monkeypatch):
    monkeypatch.setattr(_logging, "_once_keys", set())
    caplog.set_level(logging.INFO, logger="poptorch::python")
    pol = policy(partials=torch.half)
    policy(partials=torch.half)
    messages = [r.getMessage() for r in caplog.records if "setPartialsType" in r.getMessage()]
    assert len(messages) == 1 and "no effect" in messages[0]
    assert not pol.active


def test_half_partials_on_cuda_set_the_cublas_flags_for_the_call():
    matmul = torch.backends.cuda.matmul
    before = matmul.allow_fp16_accumulation
    pol = policy(partials=torch.half, device=torch.device("cuda"))
    assert pol.active
    with pol:
        assert matmul.allow_fp16_accumulation is True
        assert matmul.allow_fp16_reduced_precision_reduction is True
    assert matmul.allow_fp16_accumulation == before
    assert not policy(device=torch.device("cuda")).active  # float partials: torch default


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_half_partials_on_gpu_match_torch_with_fp16_accumulation():
    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(256, 4096, device="cuda", generator=g).half()
    b = torch.randn(4096, 256, device="cuda", generator=g).half()
    matmul = torch.backends.cuda.matmul
    with policy(partials=torch.half, device=torch.device("cuda")):
        half_partials = a @ b
    float_partials = a @ b
    old = matmul.allow_fp16_accumulation
    matmul.allow_fp16_accumulation = True
    try:
        expected = a @ b
    finally:
        matmul.allow_fp16_accumulation = old
    assert torch.equal(half_partials, expected)
    exact = a.double() @ b.double()
    assert ((half_partials.double() - exact).abs().mean()
            > (float_partials.double() - exact).abs().mean())


# --- stochastic rounding -------------------------------------------------------------
@pytest.mark.parametrize("dtype,frac", [(torch.float16, 0.3), (torch.float16, 0.85),
                                        (torch.bfloat16, 0.3)])
def test_stochastic_round_is_unbiased(dtype, frac):
    low, high = neighbours(torch.tensor([1.0]), dtype)
    value = low + frac * (high - low)
    x = value.expand(40000).contiguous()
    rounded = stochastic_round(x, dtype)
    assert rounded.dtype == dtype
    as_float = rounded.float()
    assert set(as_float.unique().tolist()) <= {low.item(), high.item()}
    ulp = (high - low).item()
    assert abs(as_float.mean().item() - value.item()) < 0.02 * ulp
    nearest_bias = abs(x.to(dtype).float().mean().item() - value.item())
    assert nearest_bias > 0.1 * ulp  # round-to-nearest is biased


def test_stochastic_round_keeps_exact_and_special_values():
    x = torch.tensor([1.0, -2.5, 0.0, float("inf"), -float("inf"), 1e6, 1e-7, -3e-8])
    out = stochastic_round(x, torch.float16)
    assert torch.equal(out[:6], x[:6].half())
    assert torch.isnan(stochastic_round(torch.tensor([float("nan")]), torch.float16)).all()
    for v in (1e-7, -3e-8):  # subnormals: one of the two neighbours
        low, high = neighbours(torch.tensor([v]), torch.float16)
        r = stochastic_round(torch.full((2000,), v), torch.float16).float()
        assert set(r.unique().tolist()) <= {low.item(), high.item()}
        assert abs(r.mean().item() - v) < 0.1 * (high - low).item()


def sgd_tiny_update(optim_cls, sr, n=20000, steps=1, **kw):
    """A half parameter at 1.0 whose float32 update is a quarter of an fp16 ulp."""
    torch.manual_seed(3)
    p = torch.nn.Parameter(torch.ones(n, dtype=torch.float16))
    opt = optim_cls([p], lr=1.0, **kw)
    pol = policy(sr=sr)
    pol.prepare_optimizer(opt)
    for _ in range(steps):
        p.grad = torch.full_like(p, 0.25 * FP16_ULP_AT_ONE)
        opt.step()
    return p, opt


@pytest.mark.parametrize("optim_cls", [poptorch.optim.SGD, torch.optim.SGD])
def test_tiny_update_survives_on_average_with_stochastic_rounding(optim_cls):
    ref = torch.nn.Parameter(torch.ones(20000))  # float32 reference
    ref_opt = torch.optim.SGD([ref], lr=1.0)
    for _ in range(3):
        ref.grad = torch.full_like(ref, 0.25 * FP16_ULP_AT_ONE)
        ref_opt.step()
    rtn, _ = sgd_tiny_update(optim_cls, sr=False, steps=3)
    assert torch.equal(rtn, torch.ones_like(rtn))  # round-to-nearest loses every update
    p, _ = sgd_tiny_update(optim_cls, sr=True, steps=3)
    assert p.dtype == torch.float16
    ulp = FP16_ULP_AT_ONE / 2  # the fp16 spacing just below 1.0
    assert abs(p.float().mean().item() - ref.mean().item()) < 0.05 * ulp


def test_torch_optimizer_keeps_dtypes_and_gradients_with_stochastic_rounding():
    p, opt = sgd_tiny_update(torch.optim.SGD, sr=True, n=64, momentum=0.9)
    grad = p.grad
    assert p.dtype == torch.float16 and grad.dtype == torch.float16
    assert opt.state[p]["momentum_buffer"].dtype == torch.float32
    p.grad = torch.zeros_like(p)
    opt.step()  # second step reuses the float32 state
    assert p.dtype == torch.float16


def test_adam_with_stochastic_rounding_is_unbiased_against_float32():
    torch.manual_seed(4)
    init = torch.randn(20000)
    grads = [torch.randn(20000) for _ in range(3)]
    ref = torch.nn.Parameter(init.half().float())
    ref_opt = torch.optim.Adam([ref], lr=1e-4)
    for optim_cls in (torch.optim.Adam, poptorch.optim.Adam):
        p = torch.nn.Parameter(init.half())
        opt = optim_cls([p], lr=1e-4)
        policy(sr=True).prepare_optimizer(opt)
        for g in grads:
            p.grad = g.half()
            opt.step()
        if optim_cls is torch.optim.Adam:
            for g in grads:
                ref.grad = g.half().float()
                ref_opt.step()
        err = p.float() - ref.detach()
        spacing = (ref.detach().half().float() - ref.detach()).abs().mean()
        assert p.dtype == torch.float16
        assert abs(err.mean().item()) < 0.05 * spacing.item() + 1e-7, optim_cls
        assert err.abs().max().item() <= 2 * 2.0 ** -10 * ref.detach().abs().max().item()


def test_stochastic_rounding_off_matches_plain_half_update():
    p, _ = sgd_tiny_update(poptorch.optim.SGD, sr=False, n=8)
    q = torch.nn.Parameter(torch.ones(8, dtype=torch.float16))
    opt = poptorch.optim.SGD([q], lr=1.0)
    q.grad = torch.full_like(q, 0.25 * FP16_ULP_AT_ONE)
    opt.step()
    assert torch.equal(p, q)


def test_stochastic_rounding_can_be_switched_off_again():
    p = torch.nn.Parameter(torch.ones(4000, dtype=torch.float16))
    opt = torch.optim.SGD([p], lr=1.0)
    policy(sr=True).prepare_optimizer(opt)
    policy(sr=False).prepare_optimizer(opt)
    p.grad = torch.full_like(p, 0.25 * FP16_ULP_AT_ONE)
    opt.step()
    assert torch.equal(p, torch.ones_like(p))


def test_stochastic_rounding_leaves_float32_parameters_exact():
    torch.manual_seed(5)
    p = torch.nn.Parameter(torch.randn(10))
    q = torch.nn.Parameter(p.detach().clone())
    opt, ref = torch.optim.SGD([p], lr=0.1), torch.optim.SGD([q], lr=0.1)
    policy(sr=True).prepare_optimizer(opt)
    p.grad = q.grad = torch.randn(10)
    opt.step()
    ref.step()
    assert torch.equal(p, q)


def test_prepare_optimizer_rejects_non_optimizers():
    with pytest.raises(poptorch.Error, match="torch.optim.Optimizer"):
        policy(sr=True).prepare_optimizer(object())


# --- floating point exceptions ---------------------------------------------------------
def test_floating_point_exceptions_raise_on_overflow_and_nan():
    model = torch.nn.Linear(2, 2)
    pol = policy(model, fpe=True)
    assert pol.checks_finite
    big = torch.tensor([60000.0], dtype=torch.float16)
    overflow = big * 2  # inf in float16, as torch computes it
    with pytest.raises(poptorch.Error, match=r"output \[1\].*inf"):
        pol.check_step((torch.ones(2), overflow), model.parameters())
    nan = torch.zeros(1) / torch.zeros(1)
    with pytest.raises(poptorch.Error, match=r"\['loss'\].*NaN"):
        pol.check_step({"loss": nan}, model.parameters())
    with torch.no_grad():
        model.bias[0] = float("nan")
    with pytest.raises(poptorch.Error, match="parameter 'bias'.*NaN"):
        pol.check_step(torch.ones(2), model.parameters())
    with pytest.raises(poptorch.Error, match="parameter 'w'"):
        pol.check_step(None, {"w": torch.tensor([float("inf")])})


def test_floating_point_exceptions_quiet_on_finite_values_or_when_disabled():
    model = torch.nn.Linear(2, 2)
    pol = policy(model, fpe=True)
    pol.check_step((torch.ones(2), [torch.arange(3)], {"a": torch.tensor(1e30)}),
                   model.parameters())
    nan = torch.tensor([float("nan")])
    policy(model).check_step(nan, [nan])  # option off: no check


# --- end to end (need the executor to use PrecisionPolicy) --------------------------
class HalfNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)
        self.bn = torch.nn.BatchNorm1d(4)
        self.register_buffer("offset", torch.full((4,), 0.1))

    def forward(self, x, target=None):
        out = self.bn(self.fc(x)) + self.offset
        if target is None:
            return out
        return out, poptorch.identity_loss(((out.float() - target) ** 2).mean(), "none")


def test_e2e_inference_downcast_and_float_statistics():
    torch.manual_seed(6)
    net = HalfNet()
    net.fc.half()
    net.bn.half()
    ref = HalfNet()
    ref.load_state_dict({k: v.float() if v.is_floating_point() else v
                         for k, v in net.state_dict().items()})
    opts = poptorch.Options()
    opts.Precision.halfFloatCasting(Cast.FloatDowncastToHalf)
    x = torch.randn(8, 4).half()
    out = poptorch.inferenceModel(net, opts)(x)
    h = F.linear(x, ref.fc.weight.half(), ref.fc.bias.half())
    ref.eval()
    expected = ref.bn(h.float()).half() + ref.offset.half()
    assert out.dtype == torch.float16
    assert torch.equal(out, expected)
    assert net.bn.running_mean.dtype == torch.float32


def test_e2e_training_raises_on_floating_point_exception():
    net = torch.nn.Linear(2, 2)

    class Exploding(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = net

        def forward(self, x):
            out = self.net(x) * 1e38 * 1e38
            return out, poptorch.identity_loss(out.sum() * 0.0 + self.net(x).sum(), "none")

    opts = poptorch.Options()
    opts.Precision.enableFloatingPointExceptions(True)
    model = poptorch.trainingModel(Exploding(), opts,
                                   optimizer=torch.optim.SGD(net.parameters(), lr=0.1))
    with pytest.raises(poptorch.Error, match="Floating point exception"):
        model(torch.ones(1, 2))


def test_e2e_training_stochastic_rounding_keeps_tiny_updates():
    torch.manual_seed(7)
    layer = torch.nn.Linear(1, 4096, bias=False).half()
    with torch.no_grad():
        layer.weight.fill_(1.0)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = layer

        def forward(self, x):
            out = self.layer(x)
            return out, poptorch.identity_loss(out.float().sum(), "none")

    opts = poptorch.Options()
    opts.Precision.enableStochasticRounding(True)
    lr = 0.25 * FP16_ULP_AT_ONE
    model = poptorch.trainingModel(Net(), opts, optimizer=poptorch.optim.SGD(
        layer.parameters(), lr=lr))
    model(torch.ones(1, 1, dtype=torch.float16))  # gradient 1 per weight: update lr
    expected = 1.0 - lr  # float32 reference of one SGD step
    assert abs(layer.weight.float().mean().item() - expected) < 0.05 * FP16_ULP_AT_ONE / 2


def test_thread_context_applies_casting_in_worker_threads():
    import threading
    a, b = torch.randn(3), torch.randn(3).half()
    results = {}
    pol = policy(casting=Cast.FloatDowncastToHalf)

    def worker(name, use_context):
        if use_context:
            with pol.thread_context():
                results[name] = a + b
        else:
            results[name] = a + b

    with pol:
        threads = [threading.Thread(target=worker, args=("with", True)),
                   threading.Thread(target=worker, args=("without", False))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert torch.equal(results["with"], a.half() + b)
    assert results["without"].dtype == torch.float32  # modes are thread-local
    with policy().thread_context():
        assert (a + b).dtype == torch.float32
