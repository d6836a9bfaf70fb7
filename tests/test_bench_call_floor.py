"""``benchmarks/bench_call_floor.py`` without timing: its wrappers give the eager model's
outputs (the same weights, the same micro-batches), and its floor does what it claims
a PopTorch inference call does (inputs checked, eval mode checked, backward refused)."""
import importlib.util
import os

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _bench():
    # (the benchmark puts its own folder on sys.path to import workloads.py)
    spec = importlib.util.spec_from_file_location(
        "bench_call_floor", os.path.join(ROOT, "benchmarks", "bench_call_floor.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _inputs(d):
    g = torch.Generator().manual_seed(0)
    return torch.randn(16 * d, 32, generator=g), torch.randint(0, 10, (16 * d,), generator=g)


@pytest.mark.parametrize("d", [1, 4])
def test_the_wrappers_give_the_eager_models_outputs(d):
    bench = _bench()
    x, y = _inputs(d)
    base, wrappers = bench.contenders("tiny", d, x, y)
    bench.check_outputs(base, wrappers, x, y, d)
    with torch.no_grad():
        parts = [base(a, b) for a, b in zip(x.split(16), y.split(16), strict=True)]
    bare = wrappers["bare"](x, y)
    got = [bare] if d == 1 else bare
    for (out, loss), (want_out, want_loss) in zip(got, parts, strict=True):
        assert torch.equal(out, want_out) and torch.equal(loss, want_loss)


def test_a_wrong_output_fails_the_check():
    bench = _bench()
    x, y = _inputs(1)
    base, wrappers = bench.contenders("tiny", 1, x, y)
    with torch.no_grad():
        base.fc2.bias.add_(1.0)  # the reference now differs from the wrappers' copies
    with pytest.raises(AssertionError, match="floor"):
        bench.check_outputs(base, wrappers, x, y, 1)


def test_the_floor_checks_inputs_and_mode_and_refuses_backward():
    bench = _bench()
    x, y = _inputs(4)
    _, wrappers = bench.contenders("tiny", 4, x, y)
    floor = wrappers["floor"]
    out, losses = floor(x, y)
    assert out.shape == (64, 10) and losses.shape == (4,) and floor.seconds > 0
    with pytest.raises(RuntimeError, match="backward"):
        losses.backward()
    with pytest.raises(ValueError, match="inputs"):
        floor(x[:32], y[:32])
    floor.model.fc1.train()
    with pytest.raises(ValueError, match="training mode"):
        floor(x, y)
