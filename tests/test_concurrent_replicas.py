"""Local replicas that run concurrently (one per GPU; forced on the CPU, where threads
over CPU copies stand in for GPUs), against plain-PyTorch loops in the same test."""
import copy
import threading

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import poptorch
from poptorch._runtime.program.concurrent_replicas import copy_model

TOL = 1e-6


@pytest.fixture(autouse=True)
def concurrent(monkeypatch):
    monkeypatch.setenv("POPTORCH_CONCURRENT_REPLICAS", "1")


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(5, 7)
        self.fc2 = nn.Linear(7, 3)

    def forward(self, x, y):
        out = self.fc2(torch.tanh(self.fc1(x)))
        return out, F.cross_entropy(out, y, reduction="sum")


def plain_loop(model, opt, x, y, d, g, r, mean):
    """Each device iteration: the sum (or mean) of the losses of its g * r micro-batches."""
    m = x.shape[0] // (d * g * r)
    xs, ys = x.split(m), y.split(m)
    for i in range(d):
        opt.zero_grad()
        for n in range(i * g * r, (i + 1) * g * r):
            _, loss = model(xs[n], ys[n])
            (loss / (g * r) if mean else loss).backward()
        opt.step()


@pytest.mark.parametrize("reduction", [poptorch.ReductionType.Mean,
                                       poptorch.ReductionType.Sum])
def test_training_matches_a_plain_loop(reduction):
    torch.manual_seed(0)
    d, g, r, m = 2, 2, 2, 3
    model = Net()
    ref = copy.deepcopy(model)
    opts = poptorch.Options().deviceIterations(d).replicationFactor(r)
    opts.Training.gradientAccumulation(g)
    opts.Training.accumulationAndReplicationReductionType(reduction)
    pop = poptorch.trainingModel(model, opts, torch.optim.Adam(model.parameters(), lr=0.01))
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    for call in range(3):
        gen = torch.Generator().manual_seed(call)
        x = torch.randn(d * g * r * m, 5, generator=gen)
        y = torch.randint(0, 3, (d * g * r * m,), generator=gen)
        pop(x, y)
        plain_loop(ref, ref_opt, x, y, d, g, r, reduction == poptorch.ReductionType.Mean)
    pop.copyWeightsToHost()
    for (name, a), b in zip(model.named_parameters(), ref.parameters(), strict=False):
        assert (a - b).abs().max() <= TOL, name


def test_replicas_really_run_at_the_same_time():
    """Each replica waits in its forward for the other: replicas run one after
    another would break the barrier (timeout) instead of passing it."""
    barrier = threading.Barrier(2, timeout=20)

    class Meeting(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 2)

        def forward(self, x):
            barrier.wait()
            return self.fc(x)

    model = Meeting()
    pop = poptorch.inferenceModel(model, poptorch.Options().replicationFactor(2))
    x = torch.randn(4, 4)
    with torch.no_grad():
        expected = model.fc(x)
    assert torch.equal(pop(x), expected)


def test_a_failing_replica_raises_its_error_and_leaves_the_weights_alone():
    fail = threading.Event()

    class FailsOnReplica1(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 2)

        def forward(self, x):
            if fail.is_set() and threading.current_thread() is not threading.main_thread():
                raise ValueError("bad micro-batch on replica 1")
            out = self.fc(x)
            return out, out.sum()

    model = FailsOnReplica1()
    pop = poptorch.trainingModel(model, poptorch.Options().replicationFactor(2),
                                 torch.optim.SGD(model.parameters(), lr=0.1))
    x = torch.randn(4, 4)
    pop(x)
    pop.copyWeightsToHost()
    before = copy.deepcopy(model.state_dict())
    fail.set()
    with pytest.raises(ValueError, match="bad micro-batch on replica 1"):
        pop(x)
    pop.copyWeightsToHost()
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, before[name]), name
    fail.clear()  # the next valid call works and trains as a plain step would
    ref = copy.deepcopy(model)
    pop(x)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for half in x.split(2):
        (ref(half)[1] / 2).backward()
    ref_opt.step()
    pop.copyWeightsToHost()
    for a, b in zip(model.parameters(), ref.parameters(), strict=False):
        assert (a - b).abs().max() <= TOL


def test_copies_call_their_own_modules_through_wrapped_forwards():
    """Instance-level forward wrappers (how autocast and precision rules hook modules)
    close over the original module; a copy must run its own module instead."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.ReLU())
    inner = model[0].forward

    def doubled(x):
        return inner(x) * 2

    model[0].forward = doubled
    replica = copy_model(model, torch.device("cpu"))
    with torch.no_grad():
        replica[0].weight.add_(1.0)
    x = torch.randn(2, 3)
    expected = torch.relu(F.linear(x, replica[0].weight, replica[0].bias) * 2)
    assert torch.equal(replica(x), expected)
    assert not torch.equal(model(x), expected)  # the original kept its own weights


class Regressor(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(4, 6)
        self.fc2 = nn.Linear(6, 1)

    def forward(self, x, t):
        out = self.fc2(torch.tanh(self.fc1(x)))
        return out, F.mse_loss(out.float(), t)


def test_autocast_models_train_in_half_on_every_replica():
    """poptorch.autocast wraps the model's forward; each replica computes in float16
    with float32 master weights, as one replica run after another would."""
    torch.manual_seed(3)
    model = Regressor().autocast()
    ref = Regressor()
    ref.load_state_dict(model.state_dict())
    pm = poptorch.trainingModel(model, poptorch.Options().replicationFactor(2),
                                torch.optim.SGD(model.parameters(), lr=0.1))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    x, t = torch.randn(8, 4), torch.randn(8, 1)
    for _ in range(3):
        out, _ = pm(x, t)
        ref_opt.zero_grad()
        outs = []
        for xs, ts in zip(x.split(4), t.split(4), strict=False):
            h = torch.tanh(F.linear(xs.half(), ref.fc1.weight.half(), ref.fc1.bias.half()))
            r_out = F.linear(h, ref.fc2.weight.half(), ref.fc2.bias.half())
            (F.mse_loss(r_out.float(), ts) / 2).backward()
            outs.append(r_out.detach())
        ref_opt.step()
        assert out.dtype == torch.float16 and torch.equal(out, torch.cat(outs))
    pm.copyWeightsToHost()
    for p, q in zip(model.parameters(), ref.parameters(), strict=False):
        assert p.dtype == torch.float32 and (p - q).abs().max() <= TOL
