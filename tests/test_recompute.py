"""recomputationCheckpoint: less memory saved for backward, the same gradients.

Each test trains the same model, from the same weights and data, with a poptorch
trainingModel (checkpoints active) and with plain PyTorch (checkpoints are identities
outside an executor), and compares weights after every step. The bytes saved for the
backward pass are counted with ``torch.autograd.graph.saved_tensors_hooks``.
"""
import copy

import pytest
import torch

import poptorch

STEPS = 3


class Checkpointed(torch.nn.Module):
    """Four Linear/Tanh/Sigmoid layers with a checkpoint after each; MSE loss."""

    def __init__(self, width=64, dropout=0.0, norm=False):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(4))
        self.norm = torch.nn.BatchNorm1d(width) if norm else None
        self.dropout = dropout

    def forward(self, x, target):
        for i, layer in enumerate(self.layers):
            x = torch.sigmoid(torch.tanh(layer(x)) * 2.0)
            if self.norm is not None and i == 1:
                x = self.norm(x)
            if self.dropout:
                x = torch.nn.functional.dropout(x, self.dropout)
            x = poptorch.recomputationCheckpoint(x)
        loss = torch.nn.functional.mse_loss(x.exp().sin(), target)
        return x, loss


class SavedBytes:
    """Counts the bytes of the tensors autograd saves for backward."""

    def __init__(self):
        self.bytes = 0

    def pack(self, t):
        self.bytes += t.numel() * t.element_size()
        return t

    def __enter__(self):
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self.hooks.__exit__(*exc)


def _data(step, batch=32, width=64):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(batch, width, generator=g), torch.rand(batch, width, generator=g)


def _train_both(model, opts=None, per_call=1):
    """Train ``model`` with poptorch and a plain copy with torch; yield after each step."""
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    pop_model = copy.deepcopy(model)
    pop = poptorch.trainingModel(pop_model, opts or poptorch.Options(),
                                 optimizer=torch.optim.SGD(pop_model.parameters(), lr=0.5))
    for step in range(STEPS):
        x, y = _data(step, batch=32 * per_call)
        torch.manual_seed(step)
        with SavedBytes() as pop_bytes:
            pop(x, y)
        torch.manual_seed(step)
        ref_opt.zero_grad()
        with SavedBytes() as ref_bytes:
            losses = [reference(xs, ys)[1] for xs, ys in zip(x.chunk(per_call),
                                                              y.chunk(per_call), strict=False)]
            (sum(losses) / per_call).backward()
        ref_opt.step()
        yield step, pop, reference, pop_bytes.bytes, ref_bytes.bytes


def _max_diff(a, b):
    return max((p - q).abs().max().item() for p, q in
               zip(list(a.parameters()) + list(a.buffers()),
                   list(b.parameters()) + list(b.buffers()), strict=False) if p.is_floating_point())


def test_checkpoint_is_identity_outside_an_executor():
    a, b = torch.randn(2), torch.randn(3)
    assert poptorch.recomputationCheckpoint(a) is a
    assert poptorch.recomputationCheckpoint(a, b) == (a, b)
    assert poptorch.recomputationCheckpoint([a, b]) == [a, b]
    with pytest.raises(TypeError, match="expects tensors"):
        poptorch.recomputationCheckpoint(a, 3)


def test_recomputation_saves_less_and_keeps_gradients():
    torch.manual_seed(0)
    model = Checkpointed()
    for step, pop, reference, pop_bytes, ref_bytes in _train_both(model):
        assert _max_diff(pop, reference) <= 1e-6
        if step > 0:  # the first forward pass discovers the model (not recomputed)
            # Kept: the input, 4 checkpoints, the weights; plain keeps ~4 tensors a layer.
            assert pop_bytes < 0.5 * ref_bytes, (pop_bytes, ref_bytes)


def test_recomputation_replays_dropout_and_keeps_batchnorm_statistics():
    torch.manual_seed(0)
    model = Checkpointed(dropout=0.3, norm=True)
    for step, pop, reference, pop_bytes, ref_bytes in _train_both(model):
        # Equal weights: the replay drew the same dropout masks. Equal buffers: the
        # replay did not update the running statistics a second time.
        assert _max_diff(pop, reference) <= 1e-6
        if step > 0:
            assert pop_bytes < 0.7 * ref_bytes, (pop_bytes, ref_bytes)


def test_recomputation_with_gradient_accumulation():
    torch.manual_seed(0)
    opts = poptorch.Options()
    opts.Training.gradientAccumulation(2)
    model = Checkpointed()
    for step, pop, reference, pop_bytes, ref_bytes in _train_both(model, opts, per_call=2):
        assert _max_diff(pop, reference) <= 1e-6
        if step > 0:
            assert pop_bytes < 0.5 * ref_bytes, (pop_bytes, ref_bytes)


def test_inference_model_is_unchanged():
    torch.manual_seed(0)
    model = Checkpointed()
    x, y = _data(0)
    expected = model(x, y)
    out = poptorch.inferenceModel(copy.deepcopy(model))(x, y)
    for got, want in zip(out, expected, strict=False):
        assert torch.allclose(got, want, atol=1e-6)


class TwoStages(Checkpointed):
    """The same model split in two pipeline stages (blocks on IPU 0 and 1)."""

    def __init__(self):
        super().__init__()
        self.layers[0] = poptorch.BeginBlock(self.layers[0], "A", ipu_id=0)
        self.layers[2] = poptorch.BeginBlock(self.layers[2], "B", ipu_id=1)


@pytest.mark.parametrize("strategy", ["pipelined", "sharded"])
def test_recomputation_in_model_parallel_runs(strategy):
    torch.manual_seed(0)
    opts = poptorch.Options()
    opts.Training.gradientAccumulation(4)
    if strategy == "sharded":
        opts.setExecutionStrategy(poptorch.ShardedExecution())
    model = TwoStages()
    for _, pop, reference, pop_bytes, ref_bytes in _train_both(model, opts, per_call=4):
        assert _max_diff(pop, reference) <= 1e-6
        # The compile-time trace discovers the model: every training step recomputes.
        assert pop_bytes < 0.5 * ref_bytes, (pop_bytes, ref_bytes)


class UpdatesViewOfCheckpoint(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(8, 8)

    def forward(self, x):
        x = poptorch.recomputationCheckpoint(self.layer(x))
        x[:, 0].add_(1.0)
        return poptorch.identity_loss(x.tanh().sum(), reduction="none")


def test_in_place_update_of_a_view_across_a_checkpoint_is_an_error():
    model = UpdatesViewOfCheckpoint()
    pop = poptorch.trainingModel(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    x = torch.randn(4, 8)
    pop(x)  # discovers the model
    with pytest.raises(poptorch.Error, match="view of a tensor made before"):
        pop(x)


class ScopedCheckpoints(torch.nn.Module):
    """Name scopes that open before a checkpoint and close after it: each layer runs
    inside ``push_name_scope`` / ``pop_name_scope`` (as Lightning's and Graphcore's CNN
    hooks add them) with a checkpoint inside the scope, then a ``NameScope`` block that
    ends in a checkpoint. Optionally split over two IPUs."""

    def __init__(self, pipelined=False, width=64):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(4))
        if pipelined:
            self.layers[0] = poptorch.BeginBlock(self.layers[0], "A", ipu_id=0)
            self.layers[2] = poptorch.BeginBlock(self.layers[2], "B", ipu_id=1)

    def forward(self, x, target):
        for i, layer in enumerate(self.layers):
            torch.ops.poptorch.push_name_scope(f"layer{i}")
            x = torch.tanh(layer(x))
            x = poptorch.recomputationCheckpoint(x)  # the scope closes in the next segment
            x = torch.sigmoid(x * 2.0)
            torch.ops.poptorch.pop_name_scope()
            with poptorch.NameScope("block"):
                x = torch.sin(x).exp()
                x = poptorch.recomputationCheckpoint(x)
        return x, torch.nn.functional.mse_loss(x.cos(), target)


@pytest.mark.parametrize("split", ["unsplit", "pipelined"])
def test_name_scopes_across_checkpoints_replay_balanced(split):
    from poptorch.ops import registered, scopes
    torch.manual_seed(0)
    opts = poptorch.Options()
    per_call = 1
    if split == "pipelined":
        opts.Training.gradientAccumulation(4)
        per_call = 4
    model = ScopedCheckpoints(pipelined=split == "pipelined")
    for step, pop, reference, pop_bytes, ref_bytes in _train_both(model, opts, per_call):
        assert _max_diff(pop, reference) <= 1e-6
        # every scope the forward passes opened was closed once, replays included
        assert registered._open() == [] and scopes.current_name_scope() == ""
        if step > 0 or split == "pipelined":  # the replays did run
            assert pop_bytes < 0.6 * ref_bytes, (pop_bytes, ref_bytes)
