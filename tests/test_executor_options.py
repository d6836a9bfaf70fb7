"""Executor options against plain-PyTorch references computed in each test."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import poptorch

TOL = 1e-5


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(6, 8)
        self.fc2 = nn.Linear(8, 3)

    def forward(self, x, target=None):
        out = self.fc2(torch.relu(self.fc1(x)))
        if target is None:
            return out
        return out, F.cross_entropy(out, target)


class BNNet(nn.Module):
    """A model with buffers (BatchNorm running statistics)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 4)
        self.bn = nn.BatchNorm1d(4)

    def forward(self, x, target=None):
        out = self.bn(self.fc(x))
        if target is None:
            return out
        return out, F.cross_entropy(out, target)


def data(rows, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 6, generator=g), torch.randint(0, 3, (rows,), generator=g)


def max_diff(a, b):
    return max((p - q).abs().max().item() for p, q in zip(a, b, strict=False))


# ----------------------------------------------------------------- inputReplicaGrouping
def group_slot(kind, k, r, size):
    """Reference input slot of replica k (written independently of the library)."""
    groups = r // size
    if kind == poptorch.CommGroupType.Consecutive:
        return k // size
    return k % groups


@pytest.mark.parametrize("kind", [poptorch.CommGroupType.Consecutive,
                                  poptorch.CommGroupType.Orthogonal])
@pytest.mark.parametrize("d,g,r,size", [(1, 1, 4, 2), (2, 3, 4, 2), (2, 1, 4, 4),
                                        (1, 2, 2, 1)])
def test_input_replica_grouping_training(kind, d, g, r, size):
    torch.manual_seed(0)
    model = MLP()
    ref = copy.deepcopy(model)
    opts = poptorch.Options().deviceIterations(d).replicationFactor(r)
    opts.Training.gradientAccumulation(g)
    opts.inputReplicaGrouping(size, kind)
    opts.outputMode(poptorch.OutputMode.All)
    pop = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.1))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    m, n = 2, r // size
    x, y = data(d * g * n * m)
    _, losses = pop(x, y)
    xs, ys = x.split(m), y.split(m)
    expected = []
    for i in range(d):
        ref_opt.zero_grad()
        for j in range(g):
            for k in range(r):  # every replica contributes, sharing its group's input
                slot = (i * g + j) * n + group_slot(kind, k, r, size)
                _, loss = ref(xs[slot], ys[slot])
                (loss / (g * r)).backward()
                expected.append(loss.detach())
        ref_opt.step()
    assert (losses.reshape(-1) - torch.stack(expected)).abs().max() <= TOL
    assert max_diff(model.parameters(), ref.parameters()) <= TOL


def test_input_replica_grouping_inference_outputs_per_replica():
    model = MLP()
    opts = poptorch.Options().deviceIterations(2).replicationFactor(4)
    opts.inputReplicaGrouping(2, poptorch.CommGroupType.Orthogonal)
    pop = poptorch.inferenceModel(model, opts)
    x, _ = data(2 * 2 * 3)  # d * (r / G) * m rows
    out = pop(x)
    xs = x.split(3)
    # Orthogonal, r=4, G=2: replicas 0, 2 read slot 0; replicas 1, 3 read slot 1.
    expected = torch.cat([model(xs[i * 2 + k % 2]) for i in range(2) for k in range(4)])
    assert out.shape == expected.shape
    assert (out - expected).abs().max() <= TOL


def test_input_replica_grouping_batch_size_error_names_the_group():
    opts = poptorch.Options().deviceIterations(2).replicationFactor(4)
    opts.inputReplicaGrouping(2, poptorch.CommGroupType.Consecutive)
    pop = poptorch.inferenceModel(MLP(), opts)
    with pytest.raises(poptorch.Error, match=r"inputReplicaGrouping size \(2\).*= 4"):
        pop(torch.randn(6, 6))
    assert pop(torch.randn(8, 6)).shape == (16, 3)  # 4 distinct inputs -> 8 replica rows


def test_input_replica_grouping_size_must_divide_replicas():
    opts = poptorch.Options().replicationFactor(4)
    opts.inputReplicaGrouping(3, poptorch.CommGroupType.Consecutive)
    pop = poptorch.inferenceModel(MLP(), opts)
    with pytest.raises(poptorch.Error, match=r"must divide replicationFactor \(4\)"):
        pop(torch.randn(4, 6))


# ----------------------------------------------------------------------------- anchors
def test_anchored_gradients_and_weights_match_reference_loop():
    torch.manual_seed(0)
    d, g, m = 3, 2, 2
    model = MLP()
    ref = copy.deepcopy(model)
    opts = poptorch.Options().deviceIterations(d)
    opts.Training.gradientAccumulation(g)
    opts.anchorTensor("grad_all", "Gradient___fc1.weight", poptorch.OutputMode.All)
    opts.anchorTensor("weight", "fc1.weight")  # Default: the model's mode (Final)
    opts.anchorTensor("bias_grad_sum", "Gradient___fc2.bias", poptorch.OutputMode.Sum)
    opts.anchorTensor("every", "fc2.bias", poptorch.OutputMode.EveryN, 3)
    opts.anchorTensor("updated", "UpdatedVar___fc2.weight")  # PopTorch's name
    pop = poptorch.trainingModel(model, opts,
                                 torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for call in range(2):
        x, y = data(d * g * m, seed=call)
        pop(x, y)
        xs, ys = x.split(m), y.split(m)
        grads, bias_grads = [], []
        for i in range(d):
            ref_opt.zero_grad()
            for n in range(i * g, (i + 1) * g):
                (ref(xs[n], ys[n])[1] / g).backward()
            grads.append(ref.fc1.weight.grad.clone())
            bias_grads.append(ref.fc2.bias.grad.clone())
            ref_opt.step()
        assert pop.getAnchoredTensor("grad_all").shape == (d, 8, 6)
        assert (pop.getAnchoredTensor("grad_all") - torch.stack(grads)).abs().max() <= TOL
        assert (pop.getAnchoredTensor("weight") - ref.fc1.weight).abs().max() <= TOL
        assert (pop.getAnchoredTensor("bias_grad_sum") - sum(bias_grads)).abs().max() <= TOL
        assert (pop.getAnchoredTensor("updated") - ref.fc2.weight).abs().max() <= TOL
        every = pop.getAnchoredTensor("every")
        assert every.shape == (1, 3) and (every[0] - ref.fc2.bias).abs().max() <= TOL


def test_anchored_buffer_in_inference_follows_each_iteration():
    class Counter(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("count", torch.zeros(()))

        def forward(self, x):
            self.count += x.shape[0]
            return x * 2

    opts = poptorch.Options().deviceIterations(3)
    opts.anchorTensor("count", "count")  # inference default: All
    pop = poptorch.inferenceModel(Counter(), opts)
    pop(torch.ones(6, 1))
    reference, count = [], 0.0
    for _ in range(3):  # plain loop: 3 iterations of 2 rows each
        count += 2
        reference.append(count)
    assert pop.getAnchoredTensor("count").tolist() == reference


def test_anchor_unknown_name_lists_valid_names():
    opts = poptorch.Options().anchorTensor("x", "fc9.weight")
    pop = poptorch.trainingModel(MLP(), opts)
    x, y = data(2)
    with pytest.raises(poptorch.Error, match=r"fc9\.weight.*Gradient___fc1\.weight"):
        pop(x, y)
    with pytest.raises(poptorch.Error, match="anchored as 'nope'"):
        ok = poptorch.trainingModel(MLP(), poptorch.Options().anchorTensor("a", "fc1.bias"))
        ok(x, y)
        assert ok.getAnchoredTensor("a").shape == (8,)
        ok.getAnchoredTensor("nope")


# ----------------------------------------------------------------------- synthetic data
class Regression(nn.Module):
    """Float inputs and targets (random normal synthetic data suits them)."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(6, 8)
        self.fc2 = nn.Linear(8, 2)

    def forward(self, x, target):
        out = self.fc2(torch.tanh(self.fc1(x)))
        return out, F.mse_loss(out, target)


# PopART's SyntheticDataMode as the options set it: enableSyntheticData(True) (or any
# true value, e.g. int(popart.SyntheticDataMode.RandomNormal) = 2) is random normal, as
# upstream documents; zeros are PopART's mode 1.
SYNTHETIC = {
    "zeros": lambda opts: opts._Popart.set("syntheticDataMode", 1),
    "random_normal_True": lambda opts: opts.enableSyntheticData(True),
    "random_normal_2": lambda opts: opts.enableSyntheticData(2),
}


@pytest.mark.parametrize("mode", sorted(SYNTHETIC))
def test_synthetic_data_runs_on_device_data_not_host_inputs(mode):
    torch.manual_seed(0)
    model = Regression()
    ref = copy.deepcopy(model)
    seen = []  # the (input, target) the device program ran on, per step
    model.register_forward_pre_hook(lambda mod, args: seen.append(args))
    d, m = 2, 256
    opts = poptorch.Options().deviceIterations(d)
    SYNTHETIC[mode](opts)
    opts.outputMode(poptorch.OutputMode.All)
    pop = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.1))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(2):
        x = torch.full((d * m, 6), float("nan"))  # never read by the device program
        y = torch.full((d * m, 2), float("nan"))
        _, losses = pop(x, y)
        steps = seen[-d:]
        for xs, ys in steps:
            assert xs.shape == (m, 6) and ys.shape == (m, 2)
            if mode == "zeros":
                assert torch.equal(xs, torch.zeros(m, 6)) and torch.equal(ys, torch.zeros(m, 2))
            else:  # standard normal samples, not the host's NaNs
                assert abs(xs.mean().item()) < 0.1 and abs(xs.std().item() - 1.0) < 0.1
                assert torch.isfinite(ys).all() and ys.std().item() > 0.5
        expected = []
        for xs, ys in steps:  # reference: plain steps on the data the device used
            ref_opt.zero_grad()
            _, loss = ref(xs, ys)
            loss.backward()
            ref_opt.step()
            expected.append(loss.detach())
        assert (losses - torch.stack(expected)).abs().max() <= TOL
    assert max_diff(model.parameters(), ref.parameters()) <= TOL
    # the same device data call after call (one slice of it per step)
    assert len({args[0].data_ptr() for args in seen}) == d
    assert all(torch.equal(a[0], b[0]) for a, b in zip(seen[:d], seen[d:], strict=True))


# ---------------------------------------------------------------- updatableNamedBuffers
class TwoBuffers(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(2, 2)
        self.register_buffer("a", torch.zeros(2))
        self.register_buffer("b", torch.zeros(2))

    def forward(self, x):
        return self.fc(x) + self.a + self.b


def test_weight_sync_copies_only_the_named_buffers():
    from poptorch._runtime.weights.sync import WeightSync
    host = TwoBuffers()
    device_copy = copy.deepcopy(host)  # separate tensors, as on an accelerator
    sync = WeightSync(host, device_copy, torch.device("cpu"))
    host.a.fill_(1.0)
    host.b.fill_(2.0)
    with torch.no_grad():
        host.fc.weight.fill_(5.0)
    sync.to_device(params=False, buffers=True, buffer_names={"a"})
    assert device_copy.a.tolist() == [1.0, 1.0] and device_copy.b.tolist() == [0.0, 0.0]
    assert not torch.equal(device_copy.fc.weight, host.fc.weight)
    sync.to_device(params=False, buffers=True)
    assert device_copy.b.tolist() == [2.0, 2.0]


def test_copy_named_buffers_to_device_uses_updatable_names():
    model = TwoBuffers()
    opts = poptorch.Options().updatableNamedBuffers(["a"])
    pop = poptorch.inferenceModel(model, opts)
    x = torch.randn(1, 2)
    pop(x)
    calls = []
    pop._compiled.weights.to_device = lambda **kw: calls.append(kw)
    pop.copyNamedBuffersToDevice()
    assert calls == [{"params": False, "buffers": True, "buffer_names": {"a"}}]


def test_updatable_named_buffers_unknown_name():
    pop = poptorch.inferenceModel(TwoBuffers(),
                                  poptorch.Options().updatableNamedBuffers(["a", "c"]))
    with pytest.raises(poptorch.Error, match=r"no buffer named 'c'; its buffers are: a, b"):
        pop(torch.randn(1, 2))


# ---------------------------------------------------------------------- broadcastBuffers
class RunningCenter(nn.Module):
    """Subtracts a running mean of its inputs, kept in a buffer updated in place."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 3)
        self.register_buffer("mean", torch.zeros(6))

    def forward(self, x, target=None):
        self.mean.mul_(0.5).add_(0.5 * x.mean(0))
        out = self.fc(x - self.mean)
        if target is None:
            return out
        return out, F.cross_entropy(out, target)


def reference_replicated(ref, opt, x, y, d, g, r, broadcast, states):
    """Plain loop over R simulated devices: replica k keeps its own buffer in states[k]."""
    m = x.shape[0] // (d * g * r)
    xs, ys = x.split(m), y.split(m)
    outs = []
    for i in range(d):
        if opt is not None:
            opt.zero_grad()
        for j in range(g):
            for k in range(r):
                n = (i * g + j) * r + k
                ref.mean.copy_(states[k])
                if opt is None:
                    with torch.no_grad():
                        outs.append(ref(xs[n]))
                else:
                    out, loss = ref(xs[n], ys[n])
                    (loss / (g * r)).backward()
                    outs.append(loss.detach())
                states[k] = ref.mean.clone()
        if opt is not None:
            opt.step()
        if broadcast:
            states[1:] = [states[0].clone() for _ in range(r - 1)]
    return outs


@pytest.fixture(params=["sequential", "concurrent"])
def replica_runs(request, monkeypatch):
    """Local replicas one after another, or concurrently in threads (the CPU standing
    in for one GPU per replica)."""
    monkeypatch.setenv("POPTORCH_CONCURRENT_REPLICAS",
                       "1" if request.param == "concurrent" else "0")
    return request.param


@pytest.mark.parametrize("broadcast", [True, False])
@pytest.mark.parametrize("training", [True, False])
def test_replicas_hold_their_own_buffers(broadcast, training, replica_runs):
    torch.manual_seed(0)
    d, g, r, m = 2, 2 if training else 1, 2, 3
    model = RunningCenter()
    ref = copy.deepcopy(model)
    opts = poptorch.Options().deviceIterations(d).replicationFactor(r)
    opts.broadcastBuffers(broadcast).outputMode(poptorch.OutputMode.All)
    ref_opt = None
    if training:
        opts.Training.gradientAccumulation(g)
        pop = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.1))
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    else:
        pop = poptorch.inferenceModel(model, opts)
    states = [ref.mean.clone() for _ in range(r)]
    for call in range(2):
        x, y = data(d * g * r * m, seed=call)
        result = pop(x, y) if training else pop(x)
        expected = reference_replicated(ref, ref_opt, x, y, d, g, r, broadcast, states)
        got = result[1] if training else result
        assert (got - (torch.stack(expected) if training else torch.cat(expected))
                ).abs().max() <= TOL
    pop.copyWeightsToHost()
    assert (model.mean - states[0]).abs().max() <= TOL  # the host sees replica 0
    assert max_diff(model.parameters(), ref.parameters()) <= TOL
    if not broadcast:
        assert not torch.allclose(states[0], states[1])  # the replicas drifted apart


def test_copy_weights_to_device_reaches_every_replica_buffer(replica_runs):
    model = RunningCenter()
    opts = poptorch.Options().replicationFactor(2).broadcastBuffers(False)
    pop = poptorch.inferenceModel(model, opts)
    x = torch.randn(4, 6)
    pop(x)
    model.mean.fill_(3.0)
    pop.copyWeightsToDevice()
    out = pop(x)
    expected = []
    for half in x.split(2):  # both replicas start again from the host's buffer
        mean = 0.5 * torch.full((6,), 3.0) + 0.5 * half.mean(0)
        expected.append(model.fc(half - mean))
    assert (out - torch.cat(expected)).abs().max() <= TOL


# ------------------------------------------------------------------ precision policy
def test_floating_point_exceptions_raise_after_a_step_with_inf():
    class Blowup(nn.Module):
        def forward(self, x):
            return torch.log(x)  # log(0) = -inf, log(-1) = NaN

    finite = torch.tensor([[1.0], [2.0]])
    opts = poptorch.Options().deviceIterations(2)
    opts.Precision.enableFloatingPointExceptions(True)
    pop = poptorch.inferenceModel(Blowup(), opts)
    assert torch.equal(pop(finite), torch.log(finite))
    bad = torch.tensor([[1.0], [-1.0]])
    assert not torch.isfinite(torch.log(bad)).all()  # reference: plain PyTorch overflows
    with pytest.raises(poptorch.Error, match="Floating point exception"):
        pop(bad)
    # Without the option the same input runs and gives PyTorch's NaN.
    plain = poptorch.inferenceModel(Blowup(), poptorch.Options().deviceIterations(2))
    assert torch.isnan(plain(bad)[1]).all()


def test_half_upcast_to_float_is_active_while_the_program_runs():
    class Mixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(4, 3))

        def forward(self, x):
            return torch.matmul(x, self.w)  # x is float16, w float32

    model = Mixed()
    x = torch.randn(2, 4).half()
    with pytest.raises(RuntimeError):
        model(x)  # plain PyTorch refuses mixed matmul
    opts = poptorch.Options()
    opts.Precision.halfFloatCasting(poptorch.HalfFloatCastingBehavior.HalfUpcastToFloat)
    out = poptorch.inferenceModel(model, opts)(x)
    assert (out - torch.matmul(x.float(), model.w)).abs().max() <= TOL


# ---------------------------------------------------------------- profiling and caching
def test_executable_caching_with_eager_is_recorded_and_logged(tmp_path, caplog):
    import logging
    cache = tmp_path / "cache"
    opts = poptorch.Options().enableExecutableCaching(str(cache))
    opts.Jit.backend("eager")
    model = MLP()
    pop = poptorch.inferenceModel(model, opts)
    x, _ = data(2)
    with caplog.at_level(logging.INFO, logger="poptorch::python"):
        assert (pop(x) - model(x)).abs().max() <= TOL
    assert "nothing to cache" in caplog.text
    assert opts.executable_cache_dir == str(cache) and not cache.exists()


def test_executable_caching_stores_the_inductor_program(tmp_path):
    torch._dynamo.reset()
    cache = tmp_path / "cache"
    opts = poptorch.Options().enableExecutableCaching(str(cache))
    opts.Jit.backend("inductor")
    model = MLP()
    pop = poptorch.inferenceModel(model, opts)
    x, _ = data(2)
    for _ in range(2):  # a float32 model compiles at its second call (docs/options.md)
        assert (pop(x) - model(x)).abs().max() <= 1e-4
    assert len(list(cache.glob("*.popcache"))) == 1, "nothing was stored in the cache"


# ------------------------------------------------------- optimizer state on accelerators
def test_device_optimizer_sync_reads_back_and_sends_loaded_state():
    from poptorch._runtime.program.optimizer import DeviceOptimizerSync
    torch.manual_seed(0)
    host = MLP()
    device_model = copy.deepcopy(host)  # stands for the device copy of an accelerator
    user = poptorch.optim.SGD(host.parameters(), lr=0.1, momentum=0.9)
    device = poptorch.optim.SGD(device_model.parameters(), lr=0.1, momentum=0.9)
    assert DeviceOptimizerSync.needed(user, device)
    assert not DeviceOptimizerSync.needed(user, user)  # CPU: one shared optimizer
    sync = DeviceOptimizerSync(user, device)
    x, y = data(4)
    sync.before_run()
    device_model(x, y)[1].backward()
    device.step()
    sync.after_run()
    ref_model = copy.deepcopy(host)
    reference = torch.optim.SGD(ref_model.parameters(), lr=0.1, momentum=0.9)
    ref_model(x, y)[1].backward()
    reference.step()
    got, want = user.state_dict()["state"], reference.state_dict()["state"]
    assert got.keys() == want.keys()
    for k in want:
        assert torch.allclose(got[k]["momentum_buffer"], want[k]["momentum_buffer"])
    # A checkpoint loaded on the host reaches the device before the next run.
    checkpoint = user.state_dict()
    for s in checkpoint["state"].values():
        s["momentum_buffer"] = torch.ones_like(s["momentum_buffer"])
    user.load_state_dict(checkpoint)
    assert user.ipu_state_is_dirty
    sync.before_run()
    assert not user.ipu_state_is_dirty
    for p in device_model.parameters():
        assert torch.equal(device.state[p]["momentum_buffer"], torch.ones_like(p))


def test_set_optimizer_keeps_the_automatic_loss_scale():
    from poptorch._runtime.numerics.loss_scaling import LossScaler
    from poptorch._runtime.config import RuntimeConfig
    from poptorch._runtime.program.optimizer import make_loss_scaler
    model = MLP()
    options = poptorch.Options()
    options.Training.setAutomaticLossScaling(True)
    opts = RuntimeConfig.of(options)  # what the engine reads
    first = poptorch.optim.SGD(model.parameters(), lr=0.1, loss_scaling=8.0)
    previous = make_loss_scaler(first, opts)
    progressed = LossScaler(first, True)
    progressed.load_state_dict(dict(previous.state_dict(), scale=2.0, good_steps=3))
    second = poptorch.optim.SGD(model.parameters(), lr=0.05, loss_scaling=8.0)
    carried = make_loss_scaler(second, opts, progressed)
    assert carried.state_dict() == progressed.state_dict()
    changed = poptorch.optim.SGD(model.parameters(), lr=0.05, loss_scaling=4.0)
    fresh = make_loss_scaler(changed, opts, progressed)
    assert fresh.state_dict() == LossScaler(changed, True).state_dict()
