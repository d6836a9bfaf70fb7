"""poptorch.optim in a plain PyTorch loop: trajectories against torch.optim (or, where
torch has no equivalent, against the published formulas written out here), attribute
rules, state dtypes and checkpoints."""
import io
import logging
import math
import subprocess
import sys
import textwrap

import pytest
import torch

import poptorch
from poptorch import optim
from poptorch.optim.attributes import (check_update, copy_hyperparameters,
                                            snapshot_constants)

STEPS = 20


def make_model(dtype=torch.float32):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(),
                               torch.nn.Linear(8, 2)).to(dtype)


def data(dtype=torch.float32):
    g = torch.Generator().manual_seed(1)
    return (torch.randn(16, 4, generator=g, dtype=dtype),
            torch.randn(16, 2, generator=g, dtype=dtype))


def train(model, opt, steps=STEPS, start=0):
    x, y = data(next(model.parameters()).dtype)
    for i in range(start, start + steps):
        opt.zero_grad()
        out = model(x * (1 + 0.05 * i))
        torch.nn.functional.mse_loss(out, y).backward()
        opt.step()


def max_diff(m1, m2):
    return max((a.double() - b.double()).abs().max().item()
               for a, b in zip(m1.parameters(), m2.parameters(), strict=False))


# --- against torch.optim --------------------------------------------------------------

TORCH_CASES = [
    ("SGD", dict(lr=0.1)),
    ("SGD", dict(lr=0.1, momentum=0.9, dampening=0.2, weight_decay=0.01)),
    ("SGD", dict(lr=0.05, momentum=0.9, nesterov=True, maximize=False)),
    ("SGD", dict(lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.01,
                 use_combined_accum=True)),
    ("SGD", dict(lr=0.05, momentum=0.8, nesterov=True, use_combined_accum=True)),
    ("SGD", dict(lr=0.01, momentum=0.5, maximize=True)),
    ("Adam", dict(lr=0.01)),
    ("Adam", dict(lr=0.01, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1)),
    ("Adam", dict(lr=0.01, maximize=True)),
    ("AdamW", dict(lr=0.01)),
    ("AdamW", dict(lr=0.02, betas=(0.85, 0.95), weight_decay=0.3)),
    ("RMSprop", dict(lr=0.01)),
    ("RMSprop", dict(lr=0.01, alpha=0.9, momentum=0.5, centered=True, weight_decay=0.01)),
    ("RMSprop", dict(lr=0.005, momentum=0.9)),
]
_POPTORCH_ONLY = ("use_combined_accum", "velocity_scaling", "loss_scaling")


@pytest.mark.parametrize("name,kwargs", TORCH_CASES)
def test_matches_torch_optim(name, kwargs):
    ours, ref = make_model(), make_model()
    opt = getattr(optim, name)(ours.parameters(), **kwargs)
    torch_kwargs = {k: v for k, v in kwargs.items() if k not in _POPTORCH_ONLY}
    train(ours, opt)
    train(ref, getattr(torch.optim, name)(ref.parameters(), **torch_kwargs))
    assert max_diff(ours, ref) <= 1e-6


def test_param_groups_match_torch():
    ours, ref = make_model(), make_model()
    groups = lambda m: [{"params": m[0].parameters(), "lr": 0.05},  # noqa: E731
                        {"params": m[2].parameters(), "weight_decay": 0.1}]
    train(ours, optim.Adam(groups(ours), lr=0.01))
    train(ref, torch.optim.Adam(groups(ref), lr=0.01))
    assert max_diff(ours, ref) <= 1e-6


def test_sgd_velocity_scaling_is_exact_in_fp32():
    """Combined variant with velocity_scaling: same trajectory, scaled buffer."""
    ours, ref = make_model(), make_model()
    opt = optim.SGD(ours.parameters(), lr=0.1, momentum=0.9, dampening=0.1,
                    use_combined_accum=True, velocity_scaling=64.0)
    train(ours, opt)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9, dampening=0.1)
    train(ref, ref_opt)
    assert max_diff(ours, ref) <= 1e-6
    p_ours, p_ref = next(ours.parameters()), next(ref.parameters())
    torch.testing.assert_close(opt.state[p_ours]["momentum_buffer"],
                               64.0 * ref_opt.state[p_ref]["momentum_buffer"])


def test_velocity_scaling_per_group_and_ignored_by_separate_variant():
    ours, ref = make_model(), make_model()
    groups = [{"params": ours[0].parameters(), "velocity_scaling": 8.0},
              {"params": ours[2].parameters(), "velocity_scaling": 0.5}]
    opt = optim.SGD(groups, lr=0.1, momentum=0.9, use_combined_accum=False)
    train(ours, opt)
    train(ref, torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9))
    assert max_diff(ours, ref) <= 1e-6
    assert [g["velocity_scaling"] for g in opt.param_groups] == [8.0, 0.5]


def test_max_grad_norm_matches_clip_grad_norm():
    ours, ref = make_model(), make_model()
    train(ours, optim.SGD(ours.parameters(), lr=0.1, momentum=0.9, max_grad_norm=0.05))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    x, y = data()
    for i in range(STEPS):
        ref_opt.zero_grad()
        torch.nn.functional.mse_loss(ref(x * (1 + 0.05 * i)), y).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        ref_opt.step()
    assert max_diff(ours, ref) <= 1e-6
    unclipped = make_model()
    train(unclipped, torch.optim.SGD(unclipped.parameters(), lr=0.1, momentum=0.9))
    assert max_diff(ours, unclipped) > 1e-3  # the clipping did bite


# --- against the published formulas -----------------------------------------------

def reference_train(model, update, steps=STEPS):
    """Plain loop applying ``update(param_index, param, grad, step)`` by hand."""
    x, y = data()
    params = list(model.parameters())
    for t in range(1, steps + 1):
        for p in params:
            p.grad = None
        torch.nn.functional.mse_loss(model(x * (1 + 0.05 * (t - 1))), y).backward()
        with torch.no_grad():
            for i, p in enumerate(params):
                update(i, p, p.grad, t)


@pytest.mark.parametrize("bias_correction,max_weight_norm,weight_decay",
                         [(True, None, 0.01), (False, None, 0.0), (True, 0.5, 0.1)])
def test_lamb_matches_paper_formula(bias_correction, max_weight_norm, weight_decay):
    lr, b1, b2, eps = 0.01, 0.9, 0.999, 1e-6
    ours, ref = make_model(), make_model()
    train(ours, optim.LAMB(ours.parameters(), lr=lr, betas=(b1, b2), eps=eps,
                           weight_decay=weight_decay, bias_correction=bias_correction,
                           max_weight_norm=max_weight_norm))
    m = [torch.zeros_like(p) for p in ref.parameters()]
    v = [torch.zeros_like(p) for p in ref.parameters()]

    def update(i, w, g, t):
        m[i] = b1 * m[i] + (1 - b1) * g
        v[i] = b2 * v[i] + (1 - b2) * g * g
        m_hat = m[i] / (1 - b1 ** t) if bias_correction else m[i]
        v_hat = v[i] / (1 - b2 ** t) if bias_correction else v[i]
        r = m_hat / (v_hat.sqrt() + eps) + weight_decay * w
        phi = w.norm() if max_weight_norm is None else min(w.norm(), max_weight_norm)
        trust = phi / r.norm() if phi > 0 and r.norm() > 0 else 1.0
        w -= lr * trust * r

    reference_train(ref, update)
    assert max_diff(ours, ref) <= 1e-6


def test_adamw_without_bias_correction_matches_formula():
    lr, b1, b2, eps, wd = 0.01, 0.9, 0.99, 1e-8, 0.05
    ours, ref = make_model(), make_model()
    train(ours, optim.AdamW(ours.parameters(), lr=lr, betas=(b1, b2), eps=eps,
                            weight_decay=wd, bias_correction=False))
    m = [torch.zeros_like(p) for p in ref.parameters()]
    v = [torch.zeros_like(p) for p in ref.parameters()]

    def update(i, w, g, t):
        w *= 1 - lr * wd
        m[i] = b1 * m[i] + (1 - b1) * g
        v[i] = b2 * v[i] + (1 - b2) * g * g
        w -= lr * m[i] / (v[i].sqrt() + eps)

    reference_train(ref, update)
    assert max_diff(ours, ref) <= 1e-6


@pytest.mark.parametrize("momentum,centered", [(0.0, False), (0.9, True)])
def test_rmsprop_tf_variant_matches_formula(momentum, centered):
    lr, alpha, eps = 0.01, 0.9, 1e-7
    ours, ref = make_model(), make_model()
    train(ours, optim.RMSprop(ours.parameters(), lr=lr, alpha=alpha, eps=eps,
                              momentum=momentum, centered=centered, use_tf_variant=True))
    ms = [torch.ones_like(p) for p in ref.parameters()]
    mg = [torch.zeros_like(p) for p in ref.parameters()]
    mom = [torch.zeros_like(p) for p in ref.parameters()]

    def update(i, w, g, t):
        ms[i] = alpha * ms[i] + (1 - alpha) * g * g
        mg[i] = alpha * mg[i] + (1 - alpha) * g
        denom = (ms[i] - mg[i] ** 2 if centered else ms[i]) + eps
        mom[i] = momentum * mom[i] + lr * g / denom.sqrt()
        w -= mom[i]

    reference_train(ref, update)
    assert max_diff(ours, ref) <= 1e-6


def test_sgd_separate_variant_velocity_accum_type_fp16():
    """Velocity stored in float16: reference rounds the velocity after each update."""
    lr, mom = 0.1, 0.9
    ours, ref = make_model(), make_model()
    opt = optim.SGD(ours.parameters(), lr=lr, momentum=mom, velocity_accum_type=torch.float16)
    train(ours, opt)
    assert all(s["momentum_buffer"].dtype == torch.float16 for s in opt.state.values())
    buf = [None] * 4

    def update(i, w, g, t):
        buf[i] = g.clone() if buf[i] is None else mom * buf[i] + g
        buf[i] = buf[i].half().float()
        w -= lr * buf[i]

    reference_train(ref, update)
    assert max_diff(ours, ref) <= 1e-6


def test_adam_accum_types_store_state_in_requested_dtypes():
    lr, b1, b2, eps = 0.01, 0.9, 0.999, 1e-8
    ours, ref = make_model(), make_model()
    opt = optim.Adam(ours.parameters(), lr=lr, accum_type=torch.float16,
                     first_order_momentum_accum_type=torch.bfloat16,
                     second_order_momentum_accum_type=torch.float32)
    train(ours, opt)
    for s in opt.state.values():
        assert s["exp_avg"].dtype == torch.bfloat16
        assert s["exp_avg_sq"].dtype == torch.float32
    m = [torch.zeros_like(p) for p in ref.parameters()]
    v = [torch.zeros_like(p) for p in ref.parameters()]

    def update(i, w, g, t):
        g = g.half().float()  # accum_type: gradients held in float16
        m[i] = (m[i] + (1 - b1) * (g - m[i])).bfloat16().float()
        v[i] = b2 * v[i] + (1 - b2) * g * g
        denom = v[i].sqrt() / math.sqrt(1 - b2 ** t) + eps
        w -= lr / (1 - b1 ** t) * m[i] / denom

    reference_train(ref, update)
    assert max_diff(ours, ref) <= 1e-5
    fp32 = make_model()
    train(fp32, optim.Adam(fp32.parameters(), lr=lr))
    assert max_diff(ours, fp32) > 1e-5  # the dtypes did change the result


def test_default_state_dtype_is_float32_for_half_params():
    model = make_model(torch.float16)
    opt = optim.Adam(model.parameters(), lr=0.01)
    train(model, opt, steps=2)
    assert all(s["exp_avg"].dtype == torch.float32 for s in opt.state.values())
    assert all(p.dtype == torch.float16 for p in model.parameters())


# --- constructor, attributes and rules ------------------------------------------------

def test_defaults_are_torch_defaults_and_constant():
    model = make_model()
    opt = optim.AdamW(model.parameters())
    ref = torch.optim.AdamW(model.parameters())
    for key in ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize"):
        assert opt.param_groups[0][key] == ref.param_groups[0][key]
        assert opt.variable_attrs.isConstant(key)
    assert opt.loss_scaling == 1.0 and opt.bias_correction is True
    assert opt.max_grad_norm == math.inf
    assert opt.accum_type == torch.float32
    assert not opt.host_state_is_dirty and not opt.ipu_state_is_dirty


def test_explicit_arguments_are_variable_and_marks_override():
    opt = optim.SGD(make_model().parameters(), lr=0.1, momentum=0.0, loss_scaling=4.0)
    va = opt.variable_attrs
    assert isinstance(va, optim.VariableAttributes)
    assert not va.isConstant("lr") and not va.isConstant("momentum")
    assert not va.isConstant("loss_scaling") and va.isConstant("weight_decay")
    va.markAsConstant("lr")
    va.markAsVariable("weight_decay")
    assert va.isConstant("lr") and not va.isConstant("weight_decay")
    with pytest.raises(poptorch.Error, match="Unknown optimizer attribute 'nonsense'"):
        va.markAsVariable("nonsense")


def test_group_values_make_attribute_variable():
    model = make_model()
    opt = optim.Adam([{"params": model[0].parameters(), "eps": 1e-4},
                      {"params": model[2].parameters()}])
    assert not opt.variable_attrs.isConstant("eps")
    assert opt.variable_attrs.isConstant("lr")


@pytest.mark.parametrize("key", ["loss_scaling", "accum_type", "max_grad_norm"])
def test_optimizer_level_attribute_in_group_is_an_error(key):
    model = make_model()
    with pytest.raises(poptorch.Error, match=f"'{key}' must have the same value"):
        optim.SGD([{"params": model.parameters(), key: 2.0}], lr=0.1)


def test_invalid_arguments():
    params = list(make_model().parameters())
    with pytest.raises(poptorch.Error, match="amsgrad"):
        optim.Adam(params, amsgrad=True)
    with pytest.raises(poptorch.Error, match="accum_type=torch.int32"):
        optim.AdamW(params, accum_type=torch.int32)
    with pytest.raises(poptorch.Error, match="differentiable"):
        optim.SGD(params, lr=0.1, differentiable=True)
    with pytest.raises(ValueError, match="max_weight_norm"):
        optim.LAMB(params, max_weight_norm=-1.0)
    with pytest.raises(ValueError):
        optim.SGD(params, lr=-1.0)


def test_subclasses_of_torch_optimizers():
    params = list(make_model().parameters())
    assert isinstance(optim.SGD(params, lr=0.1), torch.optim.SGD)
    assert isinstance(optim.RMSprop(params), torch.optim.RMSprop)
    assert isinstance(optim.LAMB(params), torch.optim.Optimizer)
    assert isinstance(optim.LAMB(params), optim.Optimizer)


def test_closure_is_called():
    model = make_model()
    opt = optim.LAMB(model.parameters())
    x, y = data()

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss

    assert opt.step(closure) is not None
    assert opt.has_state()


# --- setOptimizer rules (executor-independent part) ---------------------------------

def test_check_update_poptorch_optimizer():
    params = list(make_model().parameters())
    compiled = optim.SGD(params, lr=0.1, momentum=0.9)
    snap = snapshot_constants(compiled)
    check_update(snap, optim.SGD(params, lr=0.01, momentum=0.5), relax=False)
    with pytest.raises(poptorch.Error) as info:
        check_update(snap, optim.SGD(params, lr=0.01, momentum=0.5, weight_decay=0.1),
                     relax=False)
    msg = str(info.value)
    assert "'weight_decay'" in msg and "0.0" in msg and "0.1" in msg
    assert "markAsVariable" in msg and "relaxOptimizerAttributesChecks" in msg


def test_check_update_relaxed_warns(caplog):
    params = list(make_model().parameters())
    snap = snapshot_constants(optim.Adam(params, lr=0.1))
    with caplog.at_level(logging.WARNING, logger="poptorch"):
        check_update(snap, optim.Adam(params, lr=0.1, eps=1e-3), relax=True)
    assert "'eps'" in caplog.text and "0.001" in caplog.text


def test_check_update_structural_and_layout_errors():
    model = make_model()
    params = list(model.parameters())
    snap = snapshot_constants(optim.Adam(params, lr=0.1))
    with pytest.raises(poptorch.Error, match="first_order_momentum_accum_type"):
        check_update(snap, optim.Adam(params, lr=0.1,
                                      first_order_momentum_accum_type=torch.float16),
                     relax=True)
    with pytest.raises(poptorch.Error, match="cannot switch it to"):
        check_update(snap, optim.AdamW(params, lr=0.1), relax=True)
    with pytest.raises(poptorch.Error, match="param groups"):
        check_update(snap, optim.Adam([{"params": model[0].parameters()},
                                       {"params": model[2].parameters()}], lr=0.1),
                     relax=True)


def test_check_update_torch_optimizer_rules():
    params = list(make_model().parameters())
    snap = snapshot_constants(torch.optim.AdamW(params, lr=0.001, eps=1e-6))
    # lr always variable; non-default eps is variable.
    check_update(snap, torch.optim.AdamW(params, lr=0.0001, eps=1e-5), relax=False)
    with pytest.raises(poptorch.Error, match="'weight_decay'.*0.01.*0.1"):
        check_update(snap, torch.optim.AdamW(params, lr=0.0001, eps=1e-6, weight_decay=0.1),
                     relax=False)


def test_copy_hyperparameters_keeps_state():
    model = make_model()
    device_opt = optim.SGD(model.parameters(), lr=0.1, momentum=0.9, loss_scaling=2.0)
    train(model, device_opt, steps=2)
    state_before = {k: v["momentum_buffer"].clone() for k, v in device_opt.state.items()}
    new = optim.SGD(model.parameters(), lr=0.01, momentum=0.9, loss_scaling=8.0)
    copy_hyperparameters(new, device_opt)
    assert device_opt.param_groups[0]["lr"] == 0.01 and device_opt.loss_scaling == 8.0
    assert all(torch.equal(device_opt.state[k]["momentum_buffer"], v)
               for k, v in state_before.items())
    assert device_opt.param_groups[0]["params"][0] is next(model.parameters())


# --- state dictionary ----------------------------------------------------------------

CHECKPOINT_CASES = [
    ("SGD", dict(lr=0.1, momentum=0.9, velocity_accum_type=torch.float16)),
    ("SGD", dict(lr=0.1, momentum=0.9, use_combined_accum=True, velocity_scaling=4.0)),
    ("Adam", dict(lr=0.01, first_order_momentum_accum_type=torch.float16)),
    ("AdamW", dict(lr=0.01, second_order_momentum_accum_type=torch.bfloat16)),
    ("RMSprop", dict(lr=0.01, momentum=0.9, centered=True)),
    ("LAMB", dict(lr=0.01, max_weight_norm=2.0)),
]


@pytest.mark.parametrize("name,kwargs", CHECKPOINT_CASES)
def test_checkpoint_resume_is_bitwise_equal(name, kwargs):
    straight = make_model()
    train(straight, getattr(optim, name)(straight.parameters(), **kwargs))

    first = make_model()
    opt = getattr(optim, name)(first.parameters(), **kwargs)
    train(first, opt, steps=STEPS // 2)
    buffer = io.BytesIO()
    torch.save({"model": first.state_dict(), "optim": opt.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer)

    resumed = make_model()
    resumed[0].weight.data.zero_()  # make sure the weights come from the checkpoint
    resumed.load_state_dict(saved["model"])
    opt2 = getattr(optim, name)(resumed.parameters(), lr=123.0)  # overwritten by load
    opt2.load_state_dict(saved["optim"])
    assert opt2.ipu_state_is_dirty
    for key, value in opt.state_dict()["poptorch"].items():
        assert getattr(opt2, key) == value
    for p1, p2 in zip(first.parameters(), resumed.parameters(), strict=False):
        for key, value in opt.state[p1].items():
            assert opt2.state[p2][key].dtype == value.dtype
            assert torch.equal(opt2.state[p2][key], value)
    train(resumed, opt2, steps=STEPS // 2, start=STEPS // 2)
    for a, b in zip(straight.parameters(), resumed.parameters(), strict=False):
        assert torch.equal(a, b)


RESUME_SCRIPT = textwrap.dedent("""
    import sys, torch, poptorch
    sys.path.insert(0, {tests!r})
    from test_optim import make_model, train
    model = make_model()
    opt = poptorch.optim.Adam(model.parameters(), lr=0.01,
                              second_order_momentum_accum_type=torch.float16)
    saved = torch.load({path!r})
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["optim"])
    train(model, opt, steps=5, start=5)
    torch.save(model.state_dict(), {out!r})
""")


def test_checkpoint_resume_in_fresh_process(tmp_path):
    straight = make_model()
    train(straight, optim.Adam(straight.parameters(), lr=0.01,
                               second_order_momentum_accum_type=torch.float16), steps=10)
    model = make_model()
    opt = optim.Adam(model.parameters(), lr=0.01,
                     second_order_momentum_accum_type=torch.float16)
    train(model, opt, steps=5)
    path, out = str(tmp_path / "ckpt.pt"), str(tmp_path / "out.pt")
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, path)
    script = RESUME_SCRIPT.format(tests=str(__import__("pathlib").Path(__file__).parent),
                                  path=path, out=out)
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
    resumed = torch.load(out)
    for (name, value) in straight.state_dict().items():
        assert torch.equal(resumed[name], value), name


def test_load_state_dict_rejects_garbage():
    opt = optim.SGD(make_model().parameters(), lr=0.1)
    with pytest.raises(poptorch.Error, match="state_dict"):
        opt.load_state_dict({"foo": 1})


def test_state_dict_reads_device_state_when_dirty():
    """The executor's hook: a dirty host copy is refreshed from the device reader."""
    model, device_model = make_model(), make_model()
    host = optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    device = optim.SGD(device_model.parameters(), lr=0.1, momentum=0.9)
    train(device_model, device, steps=3)
    assert not host.has_state()
    host._device_state_reader = device.state_dict
    host.host_state_is_dirty = True
    assert host.has_state()
    sd = host.state_dict()
    assert not host.host_state_is_dirty
    ref = device.state_dict()
    for key in ref["state"]:
        assert torch.equal(sd["state"][key]["momentum_buffer"],
                           ref["state"][key]["momentum_buffer"])
