"""trainingModel / inferenceModel against plain PyTorch loops on the same micro-batches."""
import copy
import itertools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import poptorch

TOL = 1e-5


# ----------------------------------------------------------------------------- models
class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x, target=None):
        out = self.fc2(torch.relu(self.fc1(x)))
        if target is None:
            return out
        return out, F.cross_entropy(out, target)


class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4 * 4 * 4, 4)

    def forward(self, x, target=None):
        h = F.max_pool2d(torch.relu(self.bn(self.conv(x))), 2)
        out = self.fc(h.flatten(1))
        if target is None:
            return out
        return out, F.cross_entropy(out, target)


class TinyTransformer(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(11, 8)
        self.layer = nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.0,
                                                batch_first=True)
        self.head = nn.Linear(8, 4)

    def forward(self, x, target=None):
        out = self.head(self.layer(self.embed(x)).mean(1))
        if target is None:
            return out
        return out, F.cross_entropy(out, target)


def make_inputs(kind, rows, seed=1):
    g = torch.Generator().manual_seed(seed)
    if kind is MLP:
        x = torch.randn(rows, 8, generator=g)
    elif kind is SmallCNN:
        x = torch.randn(rows, 1, 8, 8, generator=g)
    else:
        x = torch.randint(0, 11, (rows, 5), generator=g)
    return x, torch.randint(0, 4, (rows,), generator=g)


def reference_training(model, opt, x, y, d, g, r):
    """Plain PyTorch: per device iteration, mean of the g*r micro-batch losses, one step."""
    micro = x.shape[0] // (d * g * r)
    xs, ys = x.split(micro), y.split(micro)
    losses = []
    for i in range(d):
        opt.zero_grad()
        for n in range(i * g * r, (i + 1) * g * r):
            _, loss = model(xs[n], ys[n])
            (loss / (g * r)).backward()
            losses.append(loss.detach())
        opt.step()
    return torch.stack(losses)


def max_param_diff(a, b):
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters(), strict=False))


# ----------------------------------------------------------------------------- training
@pytest.mark.parametrize("kind", [MLP, SmallCNN, TinyTransformer])
@pytest.mark.parametrize("d,g,r", list(itertools.product([1, 4], [1, 3], [1, 2])))
def test_training_matches_reference_loop(kind, d, g, r):
    torch.manual_seed(0)
    model = kind()
    ref = copy.deepcopy(model)
    opts = poptorch.Options().deviceIterations(d).replicationFactor(r)
    opts.Training.gradientAccumulation(g)
    opts.outputMode(poptorch.OutputMode.All)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    pop = poptorch.trainingModel(model, opts, opt)
    m = 2
    for call in range(2):
        x, y = make_inputs(kind, d * g * r * m, seed=call)
        _, losses = pop(x, y)
        ref_losses = reference_training(ref, ref_opt, x, y, d, g, r)
        assert losses.shape == ref_losses.shape or (losses.dim() == 0 and ref_losses.numel() == 1)
        assert (losses.reshape(-1) - ref_losses).abs().max() <= TOL
    assert max_param_diff(model, ref) <= TOL
    if r == 1:  # replicas hold their own buffers: see tests/test_executor_options.py
        for b, rb in zip(model.buffers(), ref.buffers(), strict=False):
            assert (b.float() - rb.float()).abs().max() <= TOL


@pytest.mark.parametrize("r", [1, 2])
def test_final_output_mode_returns_last_step_of_each_replica(r):
    d, g, m = 3, 2, 2
    model = MLP()
    ref = copy.deepcopy(model)
    opts = poptorch.Options().deviceIterations(d).replicationFactor(r)
    opts.Training.gradientAccumulation(g)
    pop = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = make_inputs(MLP, d * g * r * m)
    out, loss = pop(x, y)
    ref_losses = reference_training(ref, torch.optim.SGD(ref.parameters(), lr=0.1), x, y, d, g, r)
    expected = ref_losses[-r:]  # last accumulation step of the last iteration, per replica
    assert (loss.reshape(-1) - expected).abs().max() <= TOL
    assert out.shape == (r * m, 4)


def test_sum_reduction_matches_sum_of_losses():
    d, g = 2, 3
    model = MLP()
    ref = copy.deepcopy(model)
    opts = poptorch.Options().deviceIterations(d)
    opts.Training.gradientAccumulation(g)
    opts.Training.accumulationAndReplicationReductionType(poptorch.ReductionType.Sum)
    pop = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.02))
    x, y = make_inputs(MLP, d * g * 2)
    pop(x, y)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.02)
    for _i, (xs, ys) in enumerate(zip(x.split(2 * g), y.split(2 * g), strict=False)):
        ref_opt.zero_grad()
        for xm, ym in zip(xs.split(2), ys.split(2), strict=False):
            ref(xm, ym)[1].backward()
        ref_opt.step()
    assert max_param_diff(model, ref) <= TOL


@pytest.mark.parametrize("strategy", list(poptorch.MeanReductionStrategy))
def test_mean_reduction_strategies_agree(strategy):
    model = MLP()
    ref = copy.deepcopy(model)
    opts = poptorch.Options()
    opts.Training.gradientAccumulation(4)
    opts.Training.setMeanAccumulationAndReplicationReductionStrategy(strategy)
    pop = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = make_inputs(MLP, 8)
    pop(x, y)
    reference_training(ref, torch.optim.SGD(ref.parameters(), lr=0.1), x, y, 1, 4, 1)
    assert max_param_diff(model, ref) <= TOL


# ----------------------------------------------------------------------------- inference
@pytest.mark.parametrize("kind", [MLP, SmallCNN, TinyTransformer])
@pytest.mark.parametrize("mode,period", [(poptorch.OutputMode.All, 1),
                                         (poptorch.OutputMode.Default, 1),
                                         (poptorch.OutputMode.Final, 1),
                                         (poptorch.OutputMode.EveryN, 2),
                                         (poptorch.OutputMode.Sum, 1)])
def test_inference_output_modes(kind, mode, period):
    d, r, m = 4, 2, 3
    model = kind().eval()
    opts = poptorch.Options().deviceIterations(d).replicationFactor(r)
    opts.outputMode(mode, period) if mode == poptorch.OutputMode.EveryN else opts.outputMode(mode)
    pop = poptorch.inferenceModel(model, opts)
    x, _ = make_inputs(kind, d * r * m)
    out = pop(x)
    with torch.no_grad():
        full = model(x).reshape(d, r, m, -1)
    if mode in (poptorch.OutputMode.All, poptorch.OutputMode.Default):
        expected = full.reshape(d * r * m, -1)
    elif mode == poptorch.OutputMode.Final:
        expected = full[-1].reshape(r * m, -1)
    elif mode == poptorch.OutputMode.EveryN:
        expected = full[period - 1::period].reshape(-1, full.shape[-1])
    else:
        expected = full.sum(0).reshape(r * m, -1)
    assert out.shape == expected.shape
    assert (out - expected).abs().max() <= TOL


def test_inference_structures_and_kwargs():
    class Multi(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(3, 2)

        def forward(self, x, extra=None, *, scale=1.0, pair=None):
            out = {"a": self.fc(x) * scale, "b": [x.sum(1), x]}
            if extra is not None:
                out["a"] = out["a"] + extra
            if pair is not None:
                out["p"] = pair[0] * pair[1]
            return out

    model = Multi()
    opts = poptorch.Options().deviceIterations(2)
    pop = poptorch.inferenceModel(model, opts)
    x = torch.randn(4, 3)
    e = torch.randn(4, 2)
    pair = (torch.randn(4, 1), torch.randn(4, 1))
    out = pop(x, e, scale=2.0, pair=pair)
    expected = model(x, e, scale=2.0, pair=pair)
    assert set(out) == set(expected)
    assert torch.allclose(out["a"], expected["a"])
    assert torch.allclose(out["b"][0], expected["b"][0])
    assert torch.allclose(out["b"][1], expected["b"][1])
    assert torch.allclose(out["p"], expected["p"])


# ----------------------------------------------------------------------------- losses
def test_identity_loss_combining_losses():
    class TwoLosses(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 3)

        def forward(self, x, y):
            out = self.fc(x)
            l1 = F.cross_entropy(out, y)
            l2 = out.pow(2).mean() * 0.1
            return out, poptorch.identity_loss(l1 + l2, reduction="sum")

    model = TwoLosses()
    ref = copy.deepcopy(model)
    pop = poptorch.trainingModel(model, poptorch.Options(),
                                 torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = torch.randn(5, 4), torch.randint(0, 3, (5,))
    pop(x, y)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    out = ref.fc(x)
    (F.cross_entropy(out, y) + out.pow(2).mean() * 0.1).backward()
    ref_opt.step()
    assert max_param_diff(model, ref) <= TOL


class NestedLosses(nn.Module):
    """The final loss is an expression of other identity_loss results, wrapped again
    (``wrap=False``: the same expression in plain PyTorch)."""

    def __init__(self, wrap):
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.wrap = wrap

    def forward(self, x, y):
        out = self.fc(x)
        per_item = F.cross_entropy(out, y, reduction="none")
        if self.wrap:
            a = poptorch.identity_loss(per_item, reduction="mean")
            b = poptorch.identity_loss(out.pow(2), reduction="sum")
            return out, poptorch.identity_loss(a * 2 + 0.01 * b, reduction="none")
        return out, per_item.mean() * 2 + 0.01 * out.pow(2).sum()


def test_identity_loss_nested_in_the_final_loss_matches_pytorch():
    torch.manual_seed(0)
    model = NestedLosses(wrap=True)
    ref = NestedLosses(wrap=False)
    ref.load_state_dict(model.state_dict())
    opts = poptorch.Options().deviceIterations(2)
    opts.Training.gradientAccumulation(2)
    opts.outputMode(poptorch.OutputMode.All)
    pop = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = torch.randn(20, 4), torch.randint(0, 3, (20,))
    _, losses = pop(x, y)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ref_losses = []
    for step in range(2):  # one optimizer step on the mean of 2 micro-batch losses
        ref_opt.zero_grad()
        micro = [ref(xs, ys)[1] for xs, ys in
                 zip(x[step * 10:(step + 1) * 10].split(5), y[step * 10:(step + 1) * 10].split(5), strict=False)]
        torch.stack(micro).mean().backward()
        ref_opt.step()
        ref_losses += [m.detach() for m in micro]
    torch.testing.assert_close(losses.reshape(-1), torch.stack(ref_losses), atol=1e-6, rtol=0)
    assert max_param_diff(model, ref) <= TOL


def test_model_returning_only_loss():
    class LossOnly(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 1)

        def forward(self, x, y):
            return F.mse_loss(self.fc(x), y)

    model = LossOnly()
    ref = copy.deepcopy(model)
    pop = poptorch.trainingModel(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = torch.randn(6, 4), torch.randn(6, 1)
    loss = pop(x, y)
    ref_loss = F.mse_loss(ref.fc(x), y)
    assert abs(loss.item() - ref_loss.item()) <= TOL


def test_training_model_without_loss_raises_and_changes_nothing():
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    before = copy.deepcopy(model.state_dict())
    pop = poptorch.trainingModel(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(poptorch.Error, match="loss"):
        pop(torch.randn(4, 4))
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_legacy_positional_form_with_loss_module():
    model = nn.Linear(4, 3)
    ref = copy.deepcopy(model)
    pop = poptorch.trainingModel(model, 2, 1, 1, loss=nn.CrossEntropyLoss(),
                                 optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = torch.randn(4, 4), torch.randint(0, 3, (4,))
    pop(x, y)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for xm, ym in zip(x.split(2), y.split(2), strict=False):
        ref_opt.zero_grad()
        nn.CrossEntropyLoss()(ref(xm), ym).backward()
        ref_opt.step()
    assert max_param_diff(model, ref) <= TOL
    inf = poptorch.inferenceModel(model, 2)
    assert torch.allclose(inf(x), model(x))


# ----------------------------------------------------------------------------- errors
def test_wrong_batch_size_names_factors_and_changes_nothing():
    model = MLP()
    opts = poptorch.Options().deviceIterations(2).replicationFactor(2)
    opts.Training.gradientAccumulation(3)
    pop = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = make_inputs(MLP, 12)
    pop(x, y)  # compiled and trained once
    state = copy.deepcopy(model.state_dict())
    x, y = make_inputs(MLP, 10)
    with pytest.raises(poptorch.Error) as info:
        pop(x, y)
    msg = str(info.value)
    for text in ("10", "deviceIterations (2)", "replicationFactor (2)",
                 "gradientAccumulation (3)", "12"):
        assert text in msg
    for k, v in model.state_dict().items():
        assert torch.equal(v, state[k])


def test_inference_with_gradient_accumulation_is_an_error():
    opts = poptorch.Options()
    opts.Training.gradientAccumulation(2)
    with pytest.raises(poptorch.Error, match="gradientAccumulation"):
        poptorch.inferenceModel(MLP(), opts)  # refused when wrapped, as in PopTorch


def test_options_frozen_after_compile():
    opts = poptorch.Options()
    pop = poptorch.inferenceModel(MLP(), opts)
    pop(torch.randn(2, 8))
    with pytest.raises(poptorch.Error, match="(?i)frozen"):
        opts.deviceIterations(2)


# ----------------------------------------------------------------------------- weights
def test_shared_weights_train_eval_train():
    torch.manual_seed(3)
    model = SmallCNN()
    ref = copy.deepcopy(model)
    train = poptorch.trainingModel(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    infer = poptorch.inferenceModel(model)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(3):
        x, y = make_inputs(SmallCNN, 4, seed=step)
        train(x, y)
        ref.train()
        ref_opt.zero_grad()
        ref(x, y)[1].backward()
        ref_opt.step()
        ref.eval()
        with torch.no_grad():
            assert (infer(x) - ref(x)).abs().max() <= TOL
    # the user's module shows the trained weights with no explicit copy
    assert max_param_diff(model, ref) <= TOL
    # the training flag of the user's module is not synced
    assert model.training is True


def test_buffers_persist_and_counter():
    class Counter(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("count", torch.zeros(()))
            self.fc = nn.Linear(2, 2)

        def forward(self, x):
            self.count += 1
            return self.fc(x) + self.count

    model = Counter()
    opts = poptorch.Options().deviceIterations(3)
    pop = poptorch.inferenceModel(model, opts)
    pop(torch.randn(3, 2))
    pop(torch.randn(3, 2))
    pop.copyWeightsToHost()
    assert model.count.item() == 6


def test_host_changes_reach_device_with_copy_weights_to_device():
    model = MLP()
    pop = poptorch.inferenceModel(model)
    x = torch.randn(2, 8)
    pop(x)
    with torch.no_grad():
        model.fc2.bias.add_(1.0)
    pop.copyWeightsToDevice()
    assert torch.allclose(pop(x), model(x))


def test_load_state_dict_on_executor():
    model, other = MLP(), MLP()
    pop = poptorch.inferenceModel(model)
    x = torch.randn(2, 8)
    pop(x)
    result = pop.load_state_dict(other.state_dict())
    assert result.missing_keys == [] and result.unexpected_keys == []
    assert torch.allclose(pop(x), other(x))


def test_wrapping_an_executor_shares_weights():
    model = MLP()
    first = poptorch.trainingModel(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    second = poptorch.inferenceModel(first)
    x, y = make_inputs(MLP, 4)
    first(x, y)
    assert torch.allclose(second(x), model(x))


# ----------------------------------------------------------------------------- executor API
def test_executor_behaves_like_module():
    model = MLP()
    pop = poptorch.inferenceModel(model)
    assert pop.fc1 is model.fc1
    assert [p for p in pop.parameters()] == [p for p in model.parameters()]
    assert set(pop.state_dict()) == set(model.state_dict())
    assert "Linear" in repr(pop)
    assert pop.eval() is pop
    with pytest.raises(poptorch.Error, match="trainingModel"):
        pop.train()
    assert pop.model is model


def test_is_running_on_ipu_only_inside_executor():
    seen = []

    class Probe(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(2, 2)

        def forward(self, x):
            seen.append(poptorch.isRunningOnIpu())
            return self.fc(x)

    model = Probe()
    pop = poptorch.inferenceModel(model)
    pop(torch.randn(1, 2))
    model(torch.randn(1, 2))
    assert seen == [True, False]
    assert not poptorch.isRunningOnIpu()


def test_compile_attach_detach_destroy():
    model = MLP()
    pop = poptorch.inferenceModel(model)
    assert not pop.isCompiled()
    x = torch.randn(2, 8)
    pop.compile(x)
    assert pop.isCompiled() and pop.isAttachedToDevice()
    assert pop.compilationTime().total_seconds() >= 0
    pop.detachFromDevice()
    assert not pop.isAttachedToDevice()
    assert torch.allclose(pop(x), model(x))  # calling re-attaches
    assert pop.isAttachedToDevice()
    pop.destroy()
    assert not pop.isCompiled()
    assert torch.allclose(pop(x), model(x))


def test_random_seed_reproducible_and_host_stream_untouched():
    class Noisy(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            return F.dropout(self.fc(x), 0.5, training=True)

    def run():
        torch.manual_seed(123)
        model = Noisy()
        opts = poptorch.Options().randomSeed(42)
        pop = poptorch.inferenceModel(model, opts)
        host_before = torch.get_rng_state()
        outs = [pop(torch.ones(2, 4)) for _ in range(2)]
        assert torch.equal(torch.get_rng_state(), host_before)
        return outs, pop

    (a1, a2), pop = run()
    (b1, b2), _ = run()
    assert torch.equal(a1, b1) and torch.equal(a2, b2)
    assert not torch.equal(a1, a2)
    seed, state = pop.rng_state
    assert seed == 42
    nxt = pop(torch.ones(2, 4))
    pop.rng_state = [seed, state]  # rewind: the same draw again
    assert torch.equal(pop(torch.ones(2, 4)), nxt)


def test_perf_counters_and_latencies():
    pop = poptorch.inferenceModel(MLP(), poptorch.Options().deviceIterations(3))
    pop(torch.randn(6, 8))
    counters = pop.getPerfCounters()
    assert set(counters) == {"input", "input_complete", "output", "output_complete"}
    assert len(counters["input"][0]) == 3
    for getter in (pop.getLatency, pop.getHostIpuLatency, pop.getComputeLatency,
                   pop.getIpuHostLatency):
        lo, hi, mean = getter()
        assert 0 <= lo <= mean <= hi
    assert pop.getLatency()[2] >= pop.getComputeLatency()[2]


def test_set_optimizer_changes_lr_without_recompiling():
    model = MLP()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    pop = poptorch.trainingModel(model, optimizer=opt)
    x, y = make_inputs(MLP, 4)
    pop(x, y)
    program = pop._program
    pop.setOptimizer(torch.optim.SGD(model.parameters(), lr=0.01))
    pop(x, y)
    assert pop._program is program
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for lr in (0.1, 0.01):
        ref_opt.param_groups[0]["lr"] = lr
        ref_opt.zero_grad()
        ref(x, y)[1].backward()
        ref_opt.step()
    assert max_param_diff(model, ref) <= TOL


def test_save_and_load_round_trip(tmp_path):
    model = MLP()
    opts = poptorch.Options().deviceIterations(2)
    pop = poptorch.trainingModel(model, opts, torch.optim.Adam(model.parameters(), lr=0.01))
    x, y = make_inputs(MLP, 4)
    pop(x, y)
    path = str(tmp_path / "model.poptorch")
    pop.save(path)
    meta = poptorch.importPoptorchMetadataFromFile(path)
    assert meta["training"] is True
    restored = poptorch.load(path)
    pop(x, y)
    restored(x, y)
    assert max_param_diff(model, restored.model) <= TOL


# ----------------------------------------------------------------------------- inductor
@pytest.mark.slow
def test_inductor_backend_matches_eager():
    pytest.importorskip("torch._inductor")
    torch.manual_seed(0)
    model = MLP()
    ref = copy.deepcopy(model)
    opts = poptorch.Options().deviceIterations(2)
    opts.Jit.backend("inductor")
    opts.Training.gradientAccumulation(2)
    pop = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.05))
    x, y = make_inputs(MLP, 8)
    _, loss = pop(x, y)
    ref_losses = reference_training(ref, torch.optim.SGD(ref.parameters(), lr=0.05), x, y, 2, 2, 1)
    assert abs(loss.item() - ref_losses[-1].item()) <= TOL
    assert max_param_diff(model, ref) <= TOL


def test_optimizer_step_hooks_still_run():
    """The device loop skips torch.optim's step wrapper only while it has nothing to do."""
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    calls = []
    opt.register_step_pre_hook(lambda *a: calls.append("pre"))
    opt.register_step_post_hook(lambda *a: calls.append("post"))
    pop = poptorch.trainingModel(model, poptorch.Options().deviceIterations(2), opt)
    x, y = make_inputs(MLP, 4)
    pop(x, y)
    assert calls == ["pre", "post", "pre", "post"]


# -- buffers must stay registered during the compiling call (PopTorch's rule) ------------
class _BufferModel(nn.Module):
    def __init__(self, action):
        super().__init__()
        self.action = action
        self.register_buffer("y", torch.tensor([2.0]))
        self.fc = nn.Linear(1, 1)

    def forward(self, x):
        if self.action == "copy":
            self.y.copy_(self.y + x.sum())
        elif self.action == "remove":
            del self._buffers["y"]
        elif self.action == "reassign":
            self.y = x.sum().reshape(1)
        return self.fc(x) + 1


@pytest.mark.parametrize("action,match", [
    ("remove", r"Buffer y is removed from the model when calling the forward method"),
    ("reassign", r"Buffer y is reassigned within the model .*self\.y\.copy_\(src\)")])
def test_forward_that_removes_or_rebinds_a_buffer_is_refused_unchanged(action, match):
    torch.manual_seed(0)
    model = _BufferModel(action)
    buffer, weight = model.y, model.fc.weight.detach().clone()
    pop = poptorch.inferenceModel(model)
    with pytest.raises(poptorch.Error, match=match):
        pop(torch.ones(2, 1))
    # nothing half-changed: the same buffer object, value and weights
    assert model._buffers["y"] is buffer and torch.equal(buffer, torch.tensor([2.0]))
    assert torch.equal(model.fc.weight, weight)


def test_forward_updating_a_buffer_in_place_matches_pytorch():
    torch.manual_seed(0)
    model, ref = _BufferModel("copy"), _BufferModel("copy")
    ref.load_state_dict(model.state_dict())
    pop = poptorch.inferenceModel(model)
    for _ in range(2):
        x = torch.randn(2, 1)
        assert torch.equal(pop(x), ref(x))
    pop.copyWeightsToHost()
    assert torch.equal(model.y, ref.y)


@pytest.mark.parametrize("make_opt", [
    lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.1),
    lambda ps: poptorch.optim.Adam(ps, lr=0.1)])
def test_training_model_with_every_parameter_frozen_runs_like_pytorch(make_opt):
    class Frozen(nn.Module):
        def __init__(self):
            super().__init__()
            self.bn, self.fc = nn.BatchNorm1d(4), nn.Linear(4, 4)

        def forward(self, x, t):
            y = self.fc(self.bn(x))
            return y, F.mse_loss(y, t)

    torch.manual_seed(0)
    model = Frozen()
    for p in model.parameters():
        p.requires_grad_(False)
    ref = copy.deepcopy(model).train()
    pop = poptorch.trainingModel(model, optimizer=make_opt(model.parameters()))
    for _ in range(2):
        x, t = torch.randn(8, 4), torch.randn(8, 4)
        out, loss = pop(x, t)
        ref_out, ref_loss = ref(x, t)
        assert torch.equal(out, ref_out) and torch.equal(loss, ref_loss)
    pop.copyWeightsToHost()
    for a, b in itertools.chain(zip(model.parameters(), ref.parameters(), strict=False),
                                zip(model.buffers(), ref.buffers(), strict=False)):
        assert torch.equal(a, b)  # nothing trained; running statistics as in PyTorch
