"""Synthetic data (``enableSyntheticData`` / PopART's ``syntheticDataMode``) with models
that index with their inputs: class labels, token ids and boolean masks.

Upstream's users ran such programs with synthetic data on IPUs, which do not
bounds-check a label; here floating inputs get the mode's values (zeros, or random
normal) and integer and boolean inputs get zeros in every mode, so they index safely.
Each test trains through poptorch and replays the same steps in plain PyTorch on the
device data that the poptorch model saw.
"""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import poptorch

TOL = 1e-5
CLASSES = 5

# PopART's SyntheticDataMode as the options set it (1: zeros, 2: random normal).
MODES = {
    "zeros": lambda opts: opts._Popart.set("syntheticDataMode", 1),
    "random_normal_True": lambda opts: opts.enableSyntheticData(True),
    "random_normal_2": lambda opts: opts.enableSyntheticData(2),
}


class Classifier(nn.Module):
    """Features, token ids (embedding), a boolean mask and integer class labels."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(7, 4)
        self.fc1 = nn.Linear(6 + 4, 8)
        self.fc2 = nn.Linear(8, CLASSES)

    def forward(self, x, tokens, mask, labels):
        h = torch.cat([x, self.embed(tokens)], dim=1)
        h = torch.relu(self.fc1(h)).masked_fill(mask.unsqueeze(1), 0.0)
        out = self.fc2(h)
        return out, F.nll_loss(F.log_softmax(out, dim=1), labels)


def _host_inputs(rows):
    """Host inputs the device program must never read: labels and token ids out of
    range, NaN features."""
    return (torch.full((rows, 6), float("nan")),
            torch.full((rows,), 100, dtype=torch.int32),
            torch.ones(rows, dtype=torch.bool),
            torch.full((rows,), -1, dtype=torch.int64))


def _check_filled(mode, x, tokens, mask, labels):
    assert tokens.dtype == torch.int32 and labels.dtype == torch.int64
    assert mask.dtype == torch.bool
    # integer and boolean inputs: zeros in every mode
    assert torch.equal(tokens, torch.zeros_like(tokens))
    assert torch.equal(labels, torch.zeros_like(labels))
    assert torch.equal(mask, torch.zeros_like(mask))
    if mode == "zeros":
        assert torch.equal(x, torch.zeros_like(x))
    else:  # standard normal samples
        assert torch.isfinite(x).all()
        assert abs(x.mean().item()) < 0.15 and abs(x.std().item() - 1.0) < 0.15


@pytest.mark.parametrize("mode", sorted(MODES))
def test_classifier_trains_on_synthetic_integer_labels(mode):
    torch.manual_seed(0)
    model = Classifier()
    ref = copy.deepcopy(model)
    initial_bias = model.fc2.bias.detach().clone()
    seen = []  # the inputs the device program ran on, one tuple per step
    model.register_forward_pre_hook(lambda mod, args: seen.append(args))
    d, m = 2, 128
    opts = poptorch.Options().deviceIterations(d)
    MODES[mode](opts)
    opts.outputMode(poptorch.OutputMode.All)
    pop = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.1))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(3):
        _, losses = pop(*_host_inputs(d * m))
        steps = seen[-d:]
        expected = []
        for args in steps:
            assert args[0].shape == (m, 6)
            _check_filled(mode, *args)
            ref_opt.zero_grad()
            _, loss = ref(*args)
            loss.backward()
            ref_opt.step()
            expected.append(loss.detach())
        assert (losses - torch.stack(expected)).abs().max() <= TOL
    # the weights moved (labels are all class 0: the model learns it) and equal the
    # reference's
    assert not torch.equal(model.fc2.bias, initial_bias)
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, atol=TOL, rtol=0)


@pytest.mark.parametrize("mode", sorted(MODES))
def test_inference_indexes_with_synthetic_integer_inputs(mode):
    torch.manual_seed(1)
    model = Classifier().eval()
    seen = []
    model.register_forward_pre_hook(lambda mod, args: seen.append(args))
    opts = poptorch.Options()
    MODES[mode](opts)
    pop = poptorch.inferenceModel(model, opts)
    out, loss = pop(*_host_inputs(16))
    (args,) = seen
    _check_filled(mode, *args)
    ref_out, ref_loss = Classifier.forward(copy.deepcopy(model), *args)
    torch.testing.assert_close(out, ref_out, atol=TOL, rtol=0)
    torch.testing.assert_close(loss, ref_loss, atol=TOL, rtol=0)


@pytest.mark.parametrize("mode", ["zeros", "random_normal_True"])
def test_replicated_classifier_trains_on_synthetic_labels(mode):
    # tuto_data_loading.py --synthetic-data --replicas 2: two replicas, each stepping on
    # the same synthetic micro-batch; gradients are averaged over them.
    torch.manual_seed(2)
    model = Classifier()
    ref = copy.deepcopy(model)
    seen = []
    model.register_forward_pre_hook(lambda mod, args: seen.append(args))
    r, m = 2, 64
    opts = poptorch.Options().replicationFactor(r)
    MODES[mode](opts)
    pop = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.1))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(2):
        pop(*_host_inputs(r * m))
        replicas = seen[-r:]
        ref_opt.zero_grad()
        for args in replicas:
            _check_filled(mode, *args)
            (ref(*args)[1] / r).backward()
        ref_opt.step()
    pop.copyWeightsToHost()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, atol=TOL, rtol=0)
