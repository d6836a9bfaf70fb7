"""PopTorch Geometric's adapted layers: inside ``poptorch.trainingModel`` /
``inferenceModel`` (where they replace PyG's forward) against PyG's own layer run
eagerly on the same inputs, and captured whole by ``torch.compile``.
"""
from __future__ import annotations

import copy

import pytest
import torch

torch_geometric = pytest.importorskip("torch_geometric")

from torch_geometric import nn as pyg_nn  # noqa: E402

import poptorch  # noqa: E402
from poptorch._overrides import substitutions  # noqa: E402
from poptorch_geometric import ops  # noqa: E402


class _WithLoss(torch.nn.Module):
    """``layer(*inputs)`` and an MSE loss against ones (the loss trains the layer)."""

    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, *inputs):
        out = self.layer(*inputs)
        return out, torch.nn.functional.mse_loss(out, torch.ones_like(out))


def _train_side_by_side(layer, inputs, steps=3, lr=0.05):
    """PyG's layer trained eagerly vs the same layer in a PopTorch training model."""
    reference = _WithLoss(copy.deepcopy(layer))
    model = _WithLoss(copy.deepcopy(layer))
    optimizer = torch.optim.SGD(reference.parameters(), lr=lr)
    training = poptorch.trainingModel(
        model, optimizer=poptorch.optim.SGD(model.parameters(), lr=lr))
    for _ in range(steps):
        out, loss = training(*inputs)
        optimizer.zero_grad()
        ref_out, ref_loss = reference(*inputs)
        ref_loss.backward()
        optimizer.step()
        torch.testing.assert_close(out, ref_out.detach(), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-4, atol=1e-6)
    training.copyWeightsToHost()
    for (name, got), (_, expected) in zip(model.state_dict().items(),
                                          reference.state_dict().items(), strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5, msg=name)
    return training


def _graph(num_nodes=12, num_edges=40, features=8, seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(num_nodes, features, generator=generator)
    edge_index = torch.randint(0, num_nodes, (2, num_edges), generator=generator)
    return x, edge_index


def _with_ordered_self_loops(edge_index, num_nodes):
    """The graph without its self-loops, then one self-loop per node in node order
    (what GCNNorm produces, and what PyG's ClusterGCNConv expects without
    add_self_loops)."""
    keep = edge_index[0] != edge_index[1]
    loops = torch.arange(num_nodes).repeat(2, 1)
    return torch.cat([edge_index[:, keep], loops], dim=1)


@pytest.mark.parametrize("add_self_loops", [True, False])
def test_cluster_gcn_conv_trains_as_pyg(add_self_loops):
    torch.manual_seed(0)
    x, edge_index = _graph()
    if not add_self_loops:
        edge_index = _with_ordered_self_loops(edge_index, x.shape[0])
    layer = pyg_nn.ClusterGCNConv(8, 5, diag_lambda=0.7, add_self_loops=add_self_loops)
    _train_side_by_side(layer, (x, edge_index))


def _cluster_gcn_dense(layer, x, edge_index, add_self_loops):
    """(A + lambda diag(A)) normalised by in-degree, from a dense adjacency matrix."""
    n = x.shape[0]
    adjacency = torch.zeros(n, n)  # adjacency[target, source] = number of edges
    for source, target in edge_index.t().tolist():
        adjacency[target, source] += 1
    if add_self_loops:
        adjacency.fill_diagonal_(1.0)
    degree = adjacency.sum(1).clamp(min=1.0)
    weights = (adjacency + layer.diag_lambda * torch.diag(adjacency.diagonal())) / degree[:, None]
    return layer.lin_out(weights @ x) + layer.lin_root(x)


@pytest.mark.parametrize("add_self_loops", [True, False])
def test_cluster_gcn_conv_matches_the_dense_formula(add_self_loops):
    """Also for self-loops in any order and repeated edges, which PyG's own forward
    pairs with the wrong nodes (or rejects) without add_self_loops."""
    torch.manual_seed(1)
    x, edge_index = _graph(seed=1)
    edge_index = torch.cat([edge_index, torch.tensor([[5, 2, 5], [5, 2, 5]])], dim=1)
    layer = ops.ClusterGCNConv(8, 5, diag_lambda=0.4, add_self_loops=add_self_loops)
    torch.testing.assert_close(layer(x, edge_index),
                               _cluster_gcn_dense(layer, x, edge_index, add_self_loops))


def test_mf_conv_trains_as_pyg():
    torch.manual_seed(0)
    x, edge_index = _graph(num_edges=50)
    _train_side_by_side(pyg_nn.MFConv(8, 6, max_degree=4), (x, edge_index))


def test_mf_conv_bipartite_inputs_match_pyg():
    torch.manual_seed(0)
    x, edge_index = _graph(num_edges=30)
    x_target = torch.randn(12, 8)
    layer = pyg_nn.MFConv((8, 8), 6, max_degree=3)
    for inputs in [((x, x_target), edge_index), ((x, None), edge_index)]:
        expected = layer(*inputs)
        model = poptorch.inferenceModel(layer)  # one model per input structure
        torch.testing.assert_close(model(*inputs), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("bias", [True, False])
def test_hetero_linear_trains_as_pyg(bias):
    torch.manual_seed(0)
    x = torch.randn(10, 16)
    type_vec = torch.tensor([0, 0, 2, 1, 0, 2, 2, 2, 1, 2])  # not sorted
    _train_side_by_side(pyg_nn.HeteroLinear(16, 8, num_types=3, bias=bias), (x, type_vec))


def test_hetero_linear_refuses_unknown_types():
    layer = ops.HeteroLinear(4, 2, num_types=2)
    with pytest.raises(ValueError, match="outside"):
        layer(torch.randn(3, 4), torch.tensor([0, 2, 1]))


@pytest.mark.parametrize("affine_and_stats", [True, False])
def test_instance_norm_trains_as_pyg_and_keeps_running_stats(affine_and_stats):
    torch.manual_seed(0)
    x = torch.randn(30, 6) * 3 + 1
    batch = torch.tensor([0] * 10 + [1] * 8 + [2] * 12)
    layer = pyg_nn.InstanceNorm(6, affine=affine_and_stats,
                                track_running_stats=affine_and_stats)
    # with batch_size (a fixed number of graphs) and without (read from batch)
    for inputs in [(x, batch, 3), (x, batch)]:
        if affine_and_stats:
            _train_side_by_side(layer, inputs)
        else:  # no parameters: nothing to train, the batch statistics are used anyway
            torch.testing.assert_close(poptorch.inferenceModel(layer)(*inputs), layer(*inputs))
    if affine_and_stats:
        # evaluation uses the running statistics, as PyG does
        reference = copy.deepcopy(layer)
        reference(x, batch, 3)
        reference.eval()
        model = copy.deepcopy(layer)
        model(x, batch, 3)
        model.eval()
        inference = poptorch.inferenceModel(model)
        torch.testing.assert_close(inference(x, batch, 3), reference(x, batch, 3))


def test_instance_norm_without_batch_matches_pyg():
    torch.manual_seed(0)
    x = torch.randn(20, 4)
    _train_side_by_side(pyg_nn.InstanceNorm(4, affine=True), (x,))


def test_aggregation_sortedness_check():
    aggregation = ops.Aggregation()
    aggregation.assert_sorted_index(torch.tensor([0, 0, 1, 3]))
    aggregation.assert_sorted_index(None)
    with pytest.raises(ValueError, match="must be sorted"):
        aggregation.assert_sorted_index(torch.tensor([0, 2, 1]))


def test_sorted_aggregations_run_in_a_model_as_pyg():
    torch.manual_seed(0)
    x = torch.randn(9, 4)
    index = torch.tensor([0, 0, 1, 1, 1, 2, 3, 3, 3])
    for aggregation in [pyg_nn.aggr.SortAggregation(k=2), pyg_nn.aggr.LSTMAggregation(4, 3)]:
        expected = aggregation(x, index, dim_size=4)
        model = poptorch.inferenceModel(aggregation)
        torch.testing.assert_close(model(x, index, dim_size=4), expected)
    with pytest.raises(ValueError, match="must be sorted"):
        options = poptorch.Options()
        options.Jit.backend("eager")
        poptorch.inferenceModel(pyg_nn.aggr.SortAggregation(k=2), options)(
            x, index.flip(0), dim_size=4)


def test_adapted_layers_are_captured_whole_by_torch_compile():
    """The point of the adapted forwards: no data-dependent control flow, so
    ``torch.compile`` captures the model as one graph (PyG's own HeteroLinear branches
    on whether ``type_vec`` is sorted, and does not)."""
    torch.manual_seed(0)
    x, edge_index = _graph(num_edges=30)

    class Layers(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.cluster = pyg_nn.ClusterGCNConv(8, 8, diag_lambda=0.5)
            self.mf = pyg_nn.MFConv(8, 8, max_degree=3)
            self.hetero = pyg_nn.HeteroLinear(8, 4, num_types=2)
            self.norm = pyg_nn.InstanceNorm(4)

        def forward(self, x, edge_index, types, batch):
            h = self.mf(self.cluster(x, edge_index), edge_index)
            return self.norm(self.hetero(h, types), batch, 2)

    model = Layers()
    types = torch.tensor([0, 1] * 6)
    batch = torch.tensor([0] * 5 + [1] * 7)
    expected = model(x, edge_index, types, batch)
    with pytest.raises(RuntimeError, match="Data-dependent"):
        torch.compile(model, backend="eager", fullgraph=True)(x, edge_index, types, batch)
    torch.compiler.reset()
    with substitutions():
        got = torch.compile(model, backend="eager", fullgraph=True)(x, edge_index, types, batch)
    torch.compiler.reset()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
