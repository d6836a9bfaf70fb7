"""Output modes with a period, options frozen when a model is wrapped, and the shape
of the performance counters (PopTorch rules, checked against plain PyTorch)."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import poptorch


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 3)

    def forward(self, x, target=None):
        out = self.fc(x)
        if target is None:
            return out
        return out, F.mse_loss(out, target)


@pytest.mark.parametrize("mode", [poptorch.OutputMode.All, poptorch.OutputMode.Final,
                                  poptorch.OutputMode.Sum, poptorch.OutputMode.Default])
def test_period_with_any_mode_is_accepted_and_unused(mode):
    model = Net()
    x = torch.randn(8, 6)
    plain = poptorch.inferenceModel(copy.deepcopy(model),
                                    poptorch.Options().deviceIterations(4).outputMode(mode))
    with_period = poptorch.inferenceModel(
        copy.deepcopy(model), poptorch.Options().deviceIterations(4).outputMode(mode, 3))
    expected = plain(x)
    torch.testing.assert_close(with_period(x), expected)
    ref = model(x)  # plain PyTorch on the whole batch
    if mode in (poptorch.OutputMode.All, poptorch.OutputMode.Default):
        torch.testing.assert_close(expected, ref)
    elif mode == poptorch.OutputMode.Final:
        torch.testing.assert_close(expected, ref[-2:])
    else:
        torch.testing.assert_close(expected, ref.reshape(4, 2, 3).sum(0))


def test_wrapping_freezes_user_options_and_resolves_default_mode_in_a_copy():
    opts = poptorch.Options()
    training = poptorch.trainingModel(Net(), opts)
    inference = poptorch.inferenceModel(Net(), opts)
    assert opts.defaultOutputMode()  # the user's object is not changed...
    with pytest.raises(poptorch.Error, match="frozen"):
        opts.randomSeed(1)  # ...but can no longer be changed
    assert training.options is not opts
    assert training.options.output_mode == poptorch.OutputMode.Final
    assert inference.options.output_mode == poptorch.OutputMode.All
    clone = opts.clone()
    clone.randomSeed(1)  # a clone is free again
    assert clone.random_seed == 1


def _shape(counters, key):
    return [len(row) for row in counters[key]]


@pytest.mark.parametrize("mode,period,expected_out", [
    (poptorch.OutputMode.All, None, 4 * 2), (poptorch.OutputMode.Final, None, 1),
    (poptorch.OutputMode.Sum, None, 1), (poptorch.OutputMode.EveryN, 2, 2 * 2)])
def test_perf_counter_shapes_training(mode, period, expected_out):
    d, g = 4, 2
    opts = poptorch.Options().deviceIterations(d).outputMode(mode, period)
    opts.Training.gradientAccumulation(g)
    model = Net()
    ref = copy.deepcopy(model)
    pop = poptorch.trainingModel(model, opts,
                                 optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    x, t = torch.randn(d * g * 2, 6), torch.randn(d * g * 2, 3)
    pop(x, t)
    counters = pop.getPerfCounters()
    # two inputs, two outputs; one input transfer per micro-batch
    assert _shape(counters, "input") == _shape(counters, "input_complete") == [d * g] * 2
    assert _shape(counters, "output") == _shape(counters, "output_complete") == \
        [expected_out] * 2
    for row_in, row_done in zip(counters["input"], counters["input_complete"], strict=False):
        assert all(a <= b for a, b in zip(row_in, row_done, strict=False))
    for getter in (pop.getLatency, pop.getHostIpuLatency, pop.getComputeLatency,
                   pop.getIpuHostLatency):
        lo, hi, mean = getter()
        assert 0 <= lo <= mean <= hi
    # the counters did not disturb training: same weights as plain PyTorch
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(d):
        opt.zero_grad()
        for j in range(g):
            rows = slice((step * g + j) * 2, (step * g + j + 1) * 2)
            (F.mse_loss(ref.fc(x[rows]), t[rows]) / g).backward()
        opt.step()
    torch.testing.assert_close(model.fc.weight, ref.fc.weight)


def test_perf_counters_empty_with_synthetic_data():
    opts = poptorch.Options().deviceIterations(2).enableSyntheticData(True)
    pop = poptorch.inferenceModel(Net(), opts)
    pop(torch.randn(4, 6))
    counters = pop.getPerfCounters()
    assert _shape(counters, "input") == [0] and _shape(counters, "output") == [0]
    assert pop.getLatency() == (0.0, 0.0, 0.0)
