"""LossScaler: static scaling leaves fp32 training unchanged, rescues fp16 gradients
from underflow, and automatic scaling skips overflowing steps."""
import pytest
import torch

import poptorch
from poptorch import optim
from poptorch._runtime.numerics.loss_scaling import LossScaler


def make_model(dtype=torch.float32):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(),
                               torch.nn.Linear(8, 2)).to(dtype)


def batch(i, dtype=torch.float32):
    g = torch.Generator().manual_seed(100 + i)
    return torch.randn(16, 4, generator=g).to(dtype), torch.randn(16, 2, generator=g).to(dtype)


def scaled_step(model, opt, scaler, i, loss_fn=None):
    """One step the way the executor runs it."""
    x, y = batch(i, next(model.parameters()).dtype)
    loss = (loss_fn or torch.nn.functional.mse_loss)(model(x), y)
    scaler.scale(loss).backward()
    params = list(model.parameters())
    stepped = scaler.unscale_(params)
    if stepped:
        opt.step()
    opt.zero_grad(set_to_none=True)
    return stepped


@pytest.mark.parametrize("make_opt", [
    lambda ps: optim.SGD(ps, lr=0.1, momentum=0.9, loss_scaling=1024.0),
    lambda ps: optim.Adam(ps, lr=0.01, loss_scaling=300.0),
    lambda ps: optim.SGD(ps, lr=0.1, momentum=0.9, use_combined_accum=True,
                         velocity_scaling=16.0, loss_scaling=512.0),
])
def test_static_scaling_keeps_fp32_trajectory(make_opt):
    scaled, plain = make_model(), make_model()
    opt = make_opt(scaled.parameters())
    scaler = LossScaler(opt, automatic=False)
    ref_opt = make_opt(plain.parameters())
    for i in range(20):
        assert scaled_step(scaled, opt, scaler, i)
        x, y = batch(i)
        torch.nn.functional.mse_loss(plain(x), y).backward()  # plain loop: unscaled
        ref_opt.step()
        ref_opt.zero_grad()
    for a, b in zip(scaled.parameters(), plain.parameters(), strict=False):
        assert (a - b).abs().max() <= 1e-6


def test_scale_multiplies_loss_and_torch_optimizer_has_scale_one():
    opt = torch.optim.SGD(make_model().parameters(), lr=0.1)
    scaler = LossScaler(opt, automatic=False)
    loss = torch.tensor(3.0)
    assert scaler.scale(loss) is loss
    popt = optim.SGD(make_model().parameters(), lr=0.1, loss_scaling=8.0)
    assert LossScaler(popt, automatic=False).scale(loss).item() == 24.0


def tiny_loss(out, y):
    """A loss whose gradients (~3e-9) are below float16's smallest subnormal."""
    return (out * y).mean() * 1e-7


def test_fp16_underflow_without_and_with_loss_scaling():
    reference = make_model()  # float32 ground truth
    ref_opt = optim.Adam(reference.parameters(), lr=1e-3)
    start = [p.detach().clone() for p in make_model(torch.float16).parameters()]
    for i in range(5):
        x, y = batch(i)
        tiny_loss(reference(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()

    def run(loss_scaling):
        model = make_model(torch.float16)
        opt = optim.Adam(model.parameters(), lr=1e-3, loss_scaling=loss_scaling)
        scaler = LossScaler(opt, automatic=False)
        grads_seen = []
        for i in range(5):
            x, y = batch(i, torch.float16)
            scaler.scale(tiny_loss(model(x), y)).backward()
            grads_seen.append(sum(int(p.grad.count_nonzero()) for p in model.parameters()))
            scaler.unscale_(list(model.parameters()))
            opt.step()
            opt.zero_grad(set_to_none=True)
        return model, grads_seen

    unscaled, grads = run(1.0)
    assert grads == [0] * 5  # every gradient underflowed to zero
    for p, p0 in zip(unscaled.parameters(), start, strict=False):
        assert torch.equal(p, p0)  # nothing trained

    scaled, grads = run(2.0 ** 15)  # 2**16 would overflow float16
    assert all(n > 0 for n in grads)
    moved = 0.0
    for p, p0, r in zip(scaled.parameters(), start, reference.parameters(), strict=False):
        moved = max(moved, (p.float() - p0.float()).abs().max().item())
        # Same update as the float32 reference, up to float16 weight rounding.
        torch.testing.assert_close(p.float(), r.detach(), atol=2e-3, rtol=2e-3)
    assert moved > 1e-3


def overflow_loss(out, y):
    return torch.nn.functional.mse_loss(out, y)


def test_automatic_scaling_skips_overflowing_step():
    model = make_model()
    opt = optim.Adam(model.parameters(), lr=0.01, loss_scaling=64.0)
    scaler = LossScaler(opt, automatic=True, growth_interval=3)
    assert scaled_step(model, opt, scaler, 0)
    weights = [p.detach().clone() for p in model.parameters()]
    state = {k: {n: t.clone() for n, t in v.items()} for k, v in opt.state.items()}

    x, y = batch(1)
    loss = torch.nn.functional.mse_loss(model(x), y)
    scaler.scale(loss * float("inf")).backward()  # overflowing gradients
    assert not scaler.unscale_(list(model.parameters()))
    opt.zero_grad(set_to_none=True)
    assert scaler.scale_value == 32.0 and scaler.skipped_steps == 1
    for p, w in zip(model.parameters(), weights, strict=False):
        assert torch.equal(p, w)
    for k, v in opt.state.items():
        for n, t in v.items():
            assert torch.equal(t, state[k][n])

    # Three good steps in a row double the scale.
    for i in range(3):
        assert scaled_step(model, opt, scaler, 2 + i)
    assert scaler.scale_value == 64.0


def test_automatic_scaling_matches_reference_when_skipping():
    """Skipped steps leave the trajectory equal to training on the good batches only."""
    model, ref = make_model(), make_model()
    opt = optim.SGD(model.parameters(), lr=0.1, momentum=0.9, loss_scaling=2.0 ** 10)
    scaler = LossScaler(opt, automatic=True, growth_interval=2)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    bad = {3, 4, 9}
    for i in range(12):
        loss_fn = (lambda o, y: overflow_loss(o, y) * float("nan")) if i in bad else None
        assert scaled_step(model, opt, scaler, i, loss_fn) == (i not in bad)
        if i not in bad:
            x, y = batch(i)
            torch.nn.functional.mse_loss(ref(x), y).backward()
            ref_opt.step()
            ref_opt.zero_grad()
    for a, b in zip(model.parameters(), ref.parameters(), strict=False):
        assert (a - b).abs().max() <= 1e-6
    assert scaler.skipped_steps == 3


def test_automatic_scaling_restarts_from_new_optimizer_value():
    opt = optim.SGD(make_model().parameters(), lr=0.1, loss_scaling=16.0)
    scaler = LossScaler(opt, automatic=True)
    scaler._scale = 4.0  # as after two back-offs
    opt.loss_scaling = 128.0  # e.g. copied in by setOptimizer
    assert scaler.scale_value == 128.0


def test_static_scaling_does_not_skip():
    """As in PopTorch, a fixed scale does not check gradients: overflow shows up."""
    model = make_model()
    opt = optim.SGD(model.parameters(), lr=0.1, loss_scaling=4.0)
    scaler = LossScaler(opt, automatic=False)
    assert scaled_step(model, opt, scaler, 0, lambda o, y: overflow_loss(o, y) * float("inf"))
    assert not all(torch.isfinite(p).all() for p in model.parameters())


def test_scaler_state_saved_with_optimizer_checkpoint():
    model = make_model()
    opt = optim.Adam(model.parameters(), lr=0.01, loss_scaling=64.0)
    scaler = LossScaler(opt, automatic=True, growth_interval=2)
    for i in range(3):
        scaled_step(model, opt, scaler, i)
    saved = opt.state_dict()
    assert saved["poptorch_loss_scaler"]["scale"] == 128.0

    fresh = make_model()
    opt2 = optim.Adam(fresh.parameters(), lr=0.01, loss_scaling=64.0)
    opt2.load_state_dict(saved)
    scaler2 = LossScaler(opt2, automatic=True, growth_interval=2)  # built after loading
    assert scaler2.scale_value == 128.0 and scaler2.state_dict() == scaler.state_dict()
    opt2.load_state_dict(saved)  # and loading after building it
    assert scaler2.state_dict()["good_steps"] == 1


def test_invalid_loss_scaling():
    opt = optim.SGD(make_model().parameters(), lr=0.1, loss_scaling=-1.0)
    with pytest.raises(poptorch.Error, match="loss_scaling"):
        LossScaler(opt, automatic=False)
