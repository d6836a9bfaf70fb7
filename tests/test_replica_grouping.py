"""Replica-grouped weights (``poptorch_model.W.replicaGrouping``) against plain PyTorch.

The rule (user guide, "Grouping tensor weights across replicas"): the weight's first
dimension holds one value per group of replicas; replica ``k`` computes with its group's
value; the loss of the whole problem is the mean of the replicas' losses, so a group's
gradient is the sum of its replicas' gradients divided by the number of replicas.
"""
from __future__ import annotations

import pytest
import torch

import poptorch
from poptorch.enums import CommGroupType, VariableRetrievalMode


class ModelWithLoss(torch.nn.Module):
    def __init__(self, w):
        super().__init__()
        self.W = torch.nn.Parameter(w.clone())

    def forward(self, x):
        # torch.mm: a 2-D weight only, so each replica must see its group's slice
        z = torch.mm(x.reshape(-1, x.shape[-1]), self.W)
        return z, poptorch.identity_loss(z ** 2, reduction="mean")


ROWS, FEATURES, COLUMNS, STEPS = 8, 6, 8, 3


def _problem():
    g = torch.Generator().manual_seed(100)
    return torch.randn(ROWS, FEATURES, generator=g), torch.randn(FEATURES, COLUMNS,
                                                                   generator=g) * 0.3


def _plain(x, w):
    w = torch.nn.Parameter(w.clone())
    optimizer = torch.optim.SGD([w], lr=0.01)
    for _ in range(STEPS):
        optimizer.zero_grad()
        ((x @ w) ** 2).mean().backward()
        optimizer.step()
    return w.detach()


@pytest.mark.parametrize("input_kind,weight_kind", [
    (CommGroupType.Consecutive, CommGroupType.Orthogonal),
    (CommGroupType.Orthogonal, CommGroupType.Consecutive)])
def test_split_weight_and_data_match_the_whole_problem(input_kind, weight_kind):
    """The guide's example: 8 replicas, the weight split 4 ways by columns, the data 2
    ways by rows; trained together they equal training the whole problem."""
    x, w = _problem()
    tensor_shards, data_shards = 4, 2
    w_groups = w.reshape(FEATURES, tensor_shards, COLUMNS // tensor_shards)
    w_groups = w_groups.transpose(0, 1).contiguous()
    model = ModelWithLoss(w_groups)
    opts = poptorch.Options().replicationFactor(tensor_shards * data_shards)
    opts.inputReplicaGrouping(tensor_shards, input_kind)
    opts.outputMode(poptorch.OutputMode.All)
    training = poptorch.trainingModel(model, opts,
                                      torch.optim.SGD(model.parameters(), lr=0.01))
    training.W.replicaGrouping(weight_kind, data_shards,
                               VariableRetrievalMode.OnePerGroup)
    for _ in range(STEPS):
        training(x.reshape(data_shards, ROWS // data_shards, FEATURES))
    ours = model.W.detach().transpose(0, 1).reshape(FEATURES, COLUMNS)
    torch.testing.assert_close(ours, _plain(x, w), atol=1e-6, rtol=0)


def test_no_grouping_gives_every_replica_its_own_weight():
    replicas = 4
    g = torch.Generator().manual_seed(3)
    w = torch.randn(replicas, FEATURES, 2, generator=g)
    x = torch.randn(replicas, 2, FEATURES, generator=g)
    model = ModelWithLoss(w)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    training = poptorch.trainingModel(model, poptorch.Options().replicationFactor(replicas),
                                      optimizer)
    training.W.replicaGrouping(CommGroupType.NoGrouping, 0,
                               VariableRetrievalMode.OnePerGroup)
    for _ in range(STEPS):
        training(x.reshape(-1, FEATURES))
    reference = torch.nn.Parameter(w.clone())
    adam = torch.optim.Adam([reference], lr=0.05)
    for _ in range(STEPS):
        adam.zero_grad()
        torch.stack([((x[k] @ reference[k]) ** 2).mean() for k in range(replicas)]).mean() \
            .backward()
        adam.step()
    torch.testing.assert_close(model.W.detach(), reference.detach(), atol=1e-6, rtol=0)
    assert model.W.shape == w.shape


@pytest.mark.parametrize("kind", [CommGroupType.Consecutive, CommGroupType.Orthogonal])
def test_all_replicas_mode_keeps_one_slice_per_replica(kind):
    """AllReplicas: the host tensor holds every replica's value; replica k computes with
    slice k and every replica of a group gets the group's gradient (the sum of its
    replicas'), so slices of one group that start equal stay equal."""
    replicas, shards = 4, 2
    g = torch.Generator().manual_seed(5)
    groups = torch.randn(2, FEATURES, 2, generator=g)
    group = [k // shards if kind == CommGroupType.Consecutive else k % 2
             for k in range(replicas)]
    w = torch.stack([groups[group[k]] for k in range(replicas)])
    x = torch.randn(replicas, 2, FEATURES, generator=g)
    model = ModelWithLoss(w)
    training = poptorch.trainingModel(model, poptorch.Options().replicationFactor(replicas),
                                      torch.optim.SGD(model.parameters(), lr=0.05))
    training.W.replicaGrouping(kind, shards, VariableRetrievalMode.AllReplicas)
    for _ in range(STEPS):
        training(x.reshape(-1, FEATURES))
    reference = torch.nn.Parameter(w.clone())
    sgd = torch.optim.SGD([reference], lr=0.05)
    for _ in range(STEPS):
        sgd.zero_grad()
        torch.stack([((x[k] @ reference[k]) ** 2).mean() for k in range(replicas)]).mean() \
            .backward()
        grad = reference.grad
        reference.grad = torch.stack([
            sum(grad[j] for j in range(replicas) if group[j] == group[k])
            for k in range(replicas)])
        sgd.step()
    torch.testing.assert_close(model.W.detach(), reference.detach(), atol=1e-6, rtol=0)
    members = [j for j in range(replicas) if group[j] == group[0]]
    assert torch.equal(model.W[members[0]], model.W[members[1]])


def test_the_wrapped_parameter_still_reads_like_the_parameter():
    model = ModelWithLoss(torch.ones(2, 3, 4))
    training = poptorch.trainingModel(model, poptorch.Options().replicationFactor(2))
    assert training.W.shape == (2, 3, 4)
    assert torch.equal(training.W.data, model.W.data)


def _grouped(shape, kind, shards, mode=VariableRetrievalMode.OnePerGroup, replicas=4):
    model = ModelWithLoss(torch.ones(*shape))
    training = poptorch.trainingModel(model,
                                      poptorch.Options().replicationFactor(replicas))
    training.W.replicaGrouping(kind, shards, mode)
    return model, training


@pytest.mark.parametrize("shape,kind,shards,mode,message", [
    ((3, 6, 2), CommGroupType.Consecutive, 2, VariableRetrievalMode.OnePerGroup,
     "first dimension of 2"),
    ((2, 6, 2), CommGroupType.Orthogonal, 3, VariableRetrievalMode.OnePerGroup,
     "does not divide"),
    ((2, 6, 2), CommGroupType.Consecutive, 2, VariableRetrievalMode.AllReplicas,
     "first dimension of 4 \\(one slice per replica\\)"),
])
def test_bad_groupings_raise_before_anything_changes(shape, kind, shards, mode, message):
    model, training = _grouped(shape, kind, shards, mode)
    before = model.W.detach().clone()
    with pytest.raises(poptorch.Error, match=message):
        training(torch.ones(4 * 2, 6))
    assert torch.equal(model.W.detach(), before)


def test_grouping_after_the_first_call_is_an_error():
    model = ModelWithLoss(torch.ones(6, 2))
    training = poptorch.trainingModel(model, poptorch.Options())
    training(torch.ones(2, 6))
    with pytest.raises(poptorch.Error, match="before the model is first run"):
        training.W.replicaGrouping(CommGroupType.NoGrouping, 0,
                                   VariableRetrievalMode.OnePerGroup)
