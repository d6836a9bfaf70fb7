"""A stage backward split into its input half and its weight half
(_runtime/placement/split_backward.py) against one plain ``backward``: the same
gradients for the inputs and the weights, bit for bit; the cases it refuses; the
pipeline schedules that use it (schedules.defer_weight_halves) against plain PyTorch."""
import copy

import pytest
import torch

import poptorch
from poptorch._runtime.schedule.schedules import (Topology, check_dependencies,
                                                  defer_weight_halves, device_lanes, gpipe,
                                                  one_f_one_b)
from poptorch._runtime.placement import split_backward

FEAT = 16


class Branches(torch.nn.Module):
    """A stage with a weight used in two parallel branches (its two uses join the input
    path at two nodes: one group) and a weight applied after a nonlinearity."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(FEAT, FEAT)
        self.b = torch.nn.Linear(FEAT, FEAT)
        self.scale = torch.nn.Parameter(torch.randn(FEAT))

    def forward(self, h):
        h = torch.relu(self.a(h)) + torch.tanh(self.a(h * 2.0))
        return torch.tanh(self.b(h)) * self.scale


class Tied(torch.nn.Module):
    """A weight used again downstream of its first use."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(FEAT, FEAT)

    def forward(self, h):
        return self.a(torch.relu(self.a(h)))


def _full_and_split(module, make_roots, split=True):
    """Gradients of the input and of the weights after two micro-batches, from full
    backwards and from split ones (input halves first, weight halves at the end)."""
    torch.manual_seed(0)
    xs = [torch.randn(4, FEAT) for _ in range(2)]
    results = []
    for use_split in (False, split):
        module.zero_grad(set_to_none=True)
        halves, input_grads = [], []
        for x in xs:
            h = x.clone().requires_grad_(True)
            roots, grads = make_roots(module(h))
            half = split_backward.plan(roots, [h], list(module.parameters())) \
                if use_split else None
            if half is None:
                torch.autograd.backward(roots, grads)
            else:
                half.input_half(roots, grads, [h])
                halves.append(half)
            input_grads.append(h.grad)
        for half in halves:
            half.weight_half()
        results.append((input_grads, [p.grad.clone() for p in module.parameters()],
                        len(halves)))
    return results


def _loss(out):
    return [(out**2).mean()], [None]


def test_split_gives_the_full_backwards_gradients_bit_for_bit():
    (full_in, full_w, _), (split_in, split_w, halves) = _full_and_split(Branches(), _loss)
    assert halves == 2  # both micro-batches were split
    for a, b in zip(full_in + full_w, split_in + split_w, strict=True):
        assert torch.equal(a, b)


def test_split_with_gradients_from_a_later_stage():
    def roots(out):
        return [out], [torch.full_like(out, 0.5)]

    (full_in, full_w, _), (split_in, split_w, halves) = _full_and_split(Branches(), roots)
    assert halves == 2
    for a, b in zip(full_in + full_w, split_in + split_w, strict=True):
        assert torch.equal(a, b)


def test_weight_half_runs_the_weights_hooks():
    module = torch.nn.Linear(FEAT, FEAT)
    seen = []
    module.weight.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.clone()))
    module.bias.register_hook(lambda g: g * 2)
    (_, full_w, _), (_, split_w, halves) = _full_and_split(module, _loss)
    assert halves == 2
    assert len(seen) == 4  # two micro-batches, full and split
    for a, b in zip(full_w, split_w, strict=True):
        assert torch.equal(a, b)


def test_weight_used_again_downstream_is_not_split():
    (full_in, full_w, _), (split_in, split_w, halves) = _full_and_split(Tied(), _loss)
    assert halves == 0  # refused: the full backward ran
    for a, b in zip(full_in + full_w, split_in + split_w, strict=True):
        assert torch.equal(a, b)


def test_weight_reaching_a_root_off_the_input_path_is_not_split():
    class WeightOnlyRoot(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(FEAT, FEAT)
            self.reg = torch.nn.Parameter(torch.ones(FEAT))

        def forward(self, h):
            return self.fc(h), self.reg * 3.0  # a second output from a weight alone

    def roots(out):
        return [out[0].sum(), out[1]], [None, torch.ones(FEAT)]

    (full_in, full_w, _), (split_in, split_w, halves) = _full_and_split(WeightOnlyRoot(),
                                                                        roots)
    assert halves == 0  # refused: the full backward ran
    for a, b in zip(full_in + full_w, split_in + split_w, strict=True):
        assert torch.equal(a, b)


def test_leaf_that_is_neither_input_nor_weight_is_not_split():
    outside = torch.randn(FEAT, requires_grad=True)
    module = torch.nn.Linear(FEAT, FEAT)
    h = torch.randn(2, FEAT, requires_grad=True)
    loss = (module(h) * outside).sum()
    assert split_backward.plan([loss], [h], list(module.parameters())) is None
    assert split_backward.plan([loss], [], list(module.parameters())) is None


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_deferred_weight_halves_follow_the_last_forward(schedule):
    """Stage s splits its last s backwards, those after its last forward only."""
    stages, g = 3, 6
    per_stage = gpipe(stages, g, True) if schedule == "gpipe" else one_f_one_b(stages, g)
    topo = Topology.chain(stages)
    lanes = defer_weight_halves(per_stage, topo)
    assert lanes[0] == per_stage[0]  # the first stage hands no gradient on
    for s in (1, 2):
        kinds = [op.kind for op in lanes[s]]
        last_f = max(i for i, k in enumerate(kinds) if k == "F")
        expected = s if schedule == "gpipe" else min(s, stages - s)
        tail = kinds[last_f + 1:]
        whole = len(tail) - 2 * expected
        assert tail == ["B"] * whole + ["I"] * expected + ["W"] * expected
        assert "I" not in kinds[:last_f] and "W" not in kinds[:last_f]
    # merged onto devices, the lanes run as the engine runs them (a lane's head once
    # what it consumes ran; an input half hands its stage's backward over): no stall
    check_dependencies(device_lanes(lanes, [0, 1, 2], 3, topo), topo)


class Chain(torch.nn.Module):
    def __init__(self, stages):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(FEAT, FEAT) for _ in range(stages))
        for k, layer in enumerate(self.layers):
            poptorch.BeginBlock(layer, f"b{k}", k)

    def forward(self, x, y):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x, ((x - y)**2).mean()


@pytest.mark.parametrize("schedule", ["GPipe", "1F1B"])
def test_pipeline_with_split_backwards_matches_pytorch(schedule):
    stages, g, mb = 4, 8, 2
    model = Chain(stages)
    reference = copy.deepcopy(model)
    poptorch.removeBlocks(reference)
    strategy = poptorch.PipelinedExecution().setSchedule(schedule)
    opts = poptorch.Options()
    opts.Training.gradientAccumulation(g)
    opts.setExecutionStrategy(strategy)
    training = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(),
                                                                   lr=0.1))
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    torch.manual_seed(0)
    for _ in range(3):
        x, y = torch.randn(g * mb, FEAT), torch.randn(g * mb, FEAT)
        training(x, y)
        ref_opt.zero_grad()
        for m in range(g):
            sl = slice(m * mb, (m + 1) * mb)
            (reference(x[sl], y[sl])[1] / g).backward()
        ref_opt.step()
    training.copyWeightsToHost()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert (p.detach() - q.detach()).abs().max() <= 1e-5
    record = strategy.last_schedule
    expected = sum(s if schedule == "GPipe" else min(s, stages - s) for s in range(stages))
    assert len(record.weight_events) == expected
    assert {e.kind for e in record.weight_events} == {"W"}
    assert len(record.events) == 2 * g * stages  # one F and one B per stage and micro-batch


def test_placement_reads_the_config_frozen_at_compile():
    """The runner reads the RuntimeConfig made from the options (strategy, g, tensor
    locations), not the options object: a later change of the options reaches it not."""
    from poptorch._runtime.config import RuntimeConfig
    from poptorch._runtime.placement.build import build_runner

    opts = poptorch.Options()
    opts.Training.gradientAccumulation(8)
    strategy = poptorch.PipelinedExecution().setSchedule("GPipe")
    opts.setExecutionStrategy(strategy)
    config = RuntimeConfig.of(opts)
    assert config.placement.strategy_given
    assert config.placement.strategy is opts._execution_strategy
    opts.Training.gradientAccumulation(1)  # too shallow for 4 stages, too late
    example = ((torch.randn(2, FEAT), torch.randn(2, FEAT)), {})
    runner = build_runner(Chain(4), config, True, example=example)
    assert runner.config is config and runner.partition.num_stages == 4
    with pytest.raises(poptorch.Error, match="gradientAccumulation must be greater"):
        build_runner(Chain(4), RuntimeConfig.of(opts), True,
                     example=example)  # the options as they are now
