"""``_Popart.set("groupNormStridedChannelGrouping", True)``: group ``g`` of a group norm
holds channels ``g, g + G, g + 2G, ...``. Checked against a plain PyTorch reference that
normalises each strided group by indexing its channels."""
from __future__ import annotations

import copy

import pytest
import torch

import poptorch

GROUPS, CHANNELS = 2, 6


def reference_strided_group_norm(x: torch.Tensor, norm: torch.nn.GroupNorm) -> torch.Tensor:
    """Plain PyTorch: mean and variance over the channels of each strided group."""
    parts = [None] * x.shape[1]
    groups = norm.num_groups
    for g in range(groups):
        channels = list(range(g, x.shape[1], groups))
        sub = x[:, channels]
        dims = tuple(range(1, x.dim()))
        mean = sub.mean(dim=dims, keepdim=True)
        var = sub.var(dim=dims, unbiased=False, keepdim=True)
        normed = (sub - mean) / torch.sqrt(var + norm.eps)
        for i, c in enumerate(channels):
            parts[c] = normed[:, i]
    out = torch.stack(parts, dim=1)
    shape = (1, x.shape[1]) + (1,) * (x.dim() - 2)
    return out * norm.weight.reshape(shape) + norm.bias.reshape(shape)


class Net(torch.nn.Module):
    def __init__(self, strided_reference: bool = False) -> None:
        super().__init__()
        self.conv = torch.nn.Conv1d(3, CHANNELS, 3, padding=1)
        self.norm = torch.nn.GroupNorm(GROUPS, CHANNELS)
        self.head = torch.nn.Linear(CHANNELS * 5, 4)
        self.strided_reference = strided_reference
        with torch.no_grad():  # affine parameters that are not the identity
            self.norm.weight.uniform_(0.5, 1.5)
            self.norm.bias.uniform_(-0.5, 0.5)

    def forward(self, x, y=None):
        h = self.conv(x)
        h = (reference_strided_group_norm(h, self.norm) if self.strided_reference
             else self.norm(h))
        out = self.head(torch.relu(h).flatten(1))
        if y is None:
            return out
        return out, torch.nn.functional.cross_entropy(out, y)


def _options(**extra) -> poptorch.Options:
    opts = poptorch.Options()
    opts._Popart.set("groupNormStridedChannelGrouping", True)
    opts.showCompilationProgressBar(False)
    for name, value in extra.items():
        getattr(opts, name)(value)
    return opts


@pytest.mark.parametrize("shape", [(4, CHANNELS), (4, CHANNELS, 5), (2, CHANNELS, 3, 3)])
def test_inference_uses_strided_groups(shape):
    torch.manual_seed(0)
    norm = torch.nn.GroupNorm(GROUPS, CHANNELS)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        norm.bias.uniform_(-0.5, 0.5)
    x = torch.randn(shape)
    model = poptorch.inferenceModel(copy.deepcopy(norm), _options())
    with torch.no_grad():
        expected = reference_strided_group_norm(x, norm)
    for _ in range(2):  # the compiling call and a later one
        torch.testing.assert_close(model(x), expected, atol=1e-6, rtol=0)
    # PyTorch's consecutive groups give other numbers: the option really acts
    assert not torch.allclose(norm(x), expected, atol=1e-3)


def test_without_the_option_group_norm_is_pytorchs():
    torch.manual_seed(0)
    norm = torch.nn.GroupNorm(GROUPS, CHANNELS)
    x = torch.randn(4, CHANNELS, 5)
    opts = poptorch.Options()
    opts.showCompilationProgressBar(False)
    torch.testing.assert_close(poptorch.inferenceModel(norm, opts)(x), norm(x),
                               atol=0, rtol=0)


def _train(model, opts, batches):
    training = poptorch.trainingModel(model, opts,
                                      torch.optim.SGD(model.parameters(), lr=0.1))
    for x, y in batches:
        training(x, y)
    training.destroy()


def _plain(model, batches, per_step):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in batches:
        for xs, ys in zip(x.split(len(x) // per_step), y.split(len(y) // per_step), strict=False):
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(xs), ys).backward()
            optimizer.step()


def test_training_matches_plain_pytorch():
    torch.manual_seed(1)
    model = Net()
    reference = Net(strided_reference=True)
    reference.load_state_dict(model.state_dict())
    batches = [(torch.randn(8, 3, 5), torch.randint(0, 4, (8,))) for _ in range(3)]
    _train(model, _options(deviceIterations=2), batches)
    _plain(reference, batches, per_step=2)
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=False):
        diff = (p - q).abs().max().item()
        assert diff <= 1e-6, f"{name} differs from plain PyTorch by {diff}"


def test_pipeline_stages_use_strided_groups():
    """Stages run in worker threads: the option must reach them."""
    torch.manual_seed(2)
    model = Net()
    reference = Net(strided_reference=True)
    reference.load_state_dict(model.state_dict())
    poptorch.BeginBlock(model.norm, ipu_id=1)
    opts = _options()
    opts.setExecutionStrategy(poptorch.PipelinedExecution())
    opts.Training.gradientAccumulation(4)
    batches = [(torch.randn(8, 3, 5), torch.randint(0, 4, (8,))) for _ in range(2)]
    _train(model, opts, batches)
    # one step per call on the mean of the 4 micro-batch losses
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for x, y in batches:
        optimizer.zero_grad()
        torch.stack([torch.nn.functional.cross_entropy(reference(xs), ys) for xs, ys in
                     zip(x.split(2), y.split(2), strict=False)]).mean().backward()
        optimizer.step()
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=False):
        diff = (p - q).abs().max().item()
        assert diff <= 1e-6, f"{name} differs from plain PyTorch by {diff}"


def test_the_option_is_not_reported_as_ignored():
    opts = _options()
    opts._Popart.set("someOtherPopartOption", 1)
    ignored = opts._ignored_options()
    assert "_Popart.someOtherPopartOption" in ignored
    assert "_Popart.groupNormStridedChannelGrouping" not in ignored
