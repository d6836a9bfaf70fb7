"""PyG convolutions trained in a PopTorch training model against the same layer trained
eagerly by plain PyG/PyTorch.

Upstream's PopTorch Geometric suite builds these layers with ``add_self_loops=False``,
which PyG 2.4's ``MessagePassing`` ignored and PyG 2.8 refuses, so on PyG 2.8 its cases
stop in PyG's constructor (docs/upstream-differences.md). These tests cover the layers
with the arguments PyG 2.8 takes.
"""
from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

torch_geometric = pytest.importorskip("torch_geometric")

from torch_geometric import nn as pyg_nn  # noqa: E402

import poptorch  # noqa: E402


def _outputs(out: Any) -> list[torch.Tensor]:
    """The tensors of a layer's output: a tensor, a tuple's first item, or a dict's
    values in key order."""
    if isinstance(out, dict):
        return [out[key] for key in sorted(out)]
    if isinstance(out, tuple):
        return [out[0]]
    return [out]


class _WithLoss(torch.nn.Module):
    """``layer(*inputs)`` and one MSE loss of all its outputs against ones."""

    def __init__(self, layer: torch.nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, *inputs: Any) -> tuple[list[torch.Tensor], torch.Tensor]:
        outs = _outputs(self.layer(*inputs))
        flat = torch.cat([o.flatten() for o in outs])
        loss = torch.nn.functional.mse_loss(flat, torch.ones_like(flat))
        return outs, loss


def _train_side_by_side(layer: torch.nn.Module, inputs: tuple[Any, ...],
                        steps: int = 3, lr: float = 0.05) -> None:
    """Trains PyG's layer eagerly and a copy in a PopTorch training model on the same
    inputs; outputs, losses and the final weights must agree."""
    reference = _WithLoss(copy.deepcopy(layer))
    model = _WithLoss(copy.deepcopy(layer))
    optimizer = torch.optim.SGD(reference.parameters(), lr=lr)
    training = poptorch.trainingModel(
        model, optimizer=poptorch.optim.SGD(model.parameters(), lr=lr))
    for _ in range(steps):
        outs, loss = training(*inputs)
        optimizer.zero_grad()
        ref_outs, ref_loss = reference(*inputs)
        ref_loss.backward()
        optimizer.step()
        assert len(outs) == len(ref_outs)
        for out, ref_out in zip(outs, ref_outs, strict=True):
            torch.testing.assert_close(out, ref_out.detach(), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-4, atol=1e-6)
    training.copyWeightsToHost()
    for (name, got), (_, expected) in zip(model.state_dict().items(),
                                          reference.state_dict().items(), strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5, msg=name)


def _graph(num_nodes: int = 10, num_edges: int = 30, features: int = 8,
           seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(num_nodes, features, generator=generator)
    edge_index = torch.randint(0, num_nodes, (2, num_edges), generator=generator)
    return x, edge_index


@pytest.mark.parametrize("separate_gaussians", [True, False])
def test_gmm_conv_trains_as_pyg(separate_gaussians):
    torch.manual_seed(0)
    x, edge_index = _graph()
    pseudo = torch.rand(edge_index.shape[1], 3)
    layer = pyg_nn.GMMConv(8, 6, dim=3, kernel_size=4,
                           separate_gaussians=separate_gaussians)
    _train_side_by_side(layer, (x, edge_index, pseudo))
    bipartite = pyg_nn.GMMConv((8, 8), 6, dim=3, kernel_size=2,
                               separate_gaussians=separate_gaussians)
    _train_side_by_side(bipartite, ((x, torch.randn(10, 8)), edge_index, pseudo))


@pytest.mark.parametrize("aggr", ["softmax", "powermean"])
def test_gen_conv_trains_as_pyg(aggr):
    torch.manual_seed(0)
    x, edge_index = _graph()
    layer = pyg_nn.GENConv(8, 6, aggr=aggr, learn_t=True, learn_p=True)
    _train_side_by_side(layer, (x, edge_index))


def test_fast_rgcn_conv_trains_as_pyg():
    torch.manual_seed(0)
    x, edge_index = _graph()
    edge_type = torch.randint(0, 3, (edge_index.shape[1],))
    _train_side_by_side(pyg_nn.FastRGCNConv(8, 6, num_relations=3, num_bases=2),
                        (x, edge_index, edge_type))


def test_rgat_conv_trains_as_pyg():
    torch.manual_seed(0)
    x, edge_index = _graph(num_edges=16)
    edge_type = torch.randint(0, 3, (edge_index.shape[1],))
    edge_attr = torch.randn(edge_index.shape[1], 4)
    layer = pyg_nn.RGATConv(8, 5, num_relations=3, num_bases=3, heads=2, edge_dim=4,
                            attention_mechanism="across-relation")
    # PyG 2.8's reset_parameters leaves l2 as torch.empty gave it: give it a value
    with torch.no_grad():
        layer.l2.fill_(1 / 5)
    _train_side_by_side(layer, (x, edge_index, edge_type, edge_attr))


def test_signed_conv_trains_as_pyg():
    torch.manual_seed(0)
    x, pos_edge_index = _graph(seed=1)
    _, neg_edge_index = _graph(seed=2)
    first = pyg_nn.SignedConv(8, 6, first_aggr=True)
    _train_side_by_side(first, (x, pos_edge_index, neg_edge_index))
    second = pyg_nn.SignedConv(6, 4, first_aggr=False)
    _train_side_by_side(second, (torch.randn(10, 12), pos_edge_index, neg_edge_index))


@pytest.mark.parametrize("use_attention", [False, True])
def test_hypergraph_conv_trains_as_pyg(use_attention):
    torch.manual_seed(0)
    x = torch.randn(6, 8)
    hyperedge_index = torch.tensor([[0, 1, 2, 3, 4, 5, 0, 2], [0, 0, 1, 1, 1, 2, 2, 2]])
    hyperedge_weight = torch.tensor([1.0, 0.5, 2.0])
    hyperedge_attr = torch.randn(3, 8)
    # (PyG 2.8 takes heads > 1 only with attention)
    layer = pyg_nn.HypergraphConv(8, 6, use_attention=use_attention,
                                  heads=2 if use_attention else 1)
    _train_side_by_side(layer, (x, hyperedge_index, hyperedge_weight, hyperedge_attr, 3))


def test_heat_conv_trains_as_pyg():
    torch.manual_seed(0)
    x, edge_index = _graph()
    node_type = torch.randint(0, 3, (10,))
    edge_type = torch.randint(0, 2, (edge_index.shape[1],))
    edge_attr = torch.randn(edge_index.shape[1], 2)
    layer = pyg_nn.HEATConv(8, 6, num_node_types=3, num_edge_types=2, edge_type_emb_dim=5,
                            edge_dim=2, edge_attr_emb_dim=4, heads=2)
    _train_side_by_side(layer, (x, edge_index, node_type, edge_type, edge_attr))


def _hetero_graph() -> tuple[dict[str, torch.Tensor], dict[tuple[str, str, str], torch.Tensor]]:
    x_dict = {"paper": torch.randn(7, 8), "author": torch.randn(5, 6)}
    edge_index_dict = {
        ("paper", "cites", "paper"): torch.randint(0, 7, (2, 12)),
        ("author", "writes", "paper"): torch.stack([torch.randint(0, 5, (10,)),
                                                    torch.randint(0, 7, (10,))]),
        ("paper", "rev_writes", "author"): torch.stack([torch.randint(0, 7, (10,)),
                                                        torch.randint(0, 5, (10,))]),
    }
    return x_dict, edge_index_dict


def test_han_conv_trains_as_pyg():
    torch.manual_seed(0)
    x_dict, edge_index_dict = _hetero_graph()
    metadata = (list(x_dict), list(edge_index_dict))
    layer = pyg_nn.HANConv({"paper": 8, "author": 6}, 16, metadata, heads=2)
    _train_side_by_side(layer, (x_dict, edge_index_dict))


@pytest.mark.parametrize("aggr", ["sum", "cat"])
def test_hetero_conv_of_sage_gcn_and_gat_trains_as_pyg(aggr):
    torch.manual_seed(0)
    x_dict, edge_index_dict = _hetero_graph()
    layer = pyg_nn.HeteroConv({
        ("paper", "cites", "paper"): pyg_nn.GCNConv(8, 16, add_self_loops=False),
        ("author", "writes", "paper"): pyg_nn.SAGEConv((6, 8), 16),
        ("paper", "rev_writes", "author"): pyg_nn.GATConv((8, 6), 16,
                                                          add_self_loops=False),
    }, aggr=aggr)
    _train_side_by_side(layer, (x_dict, edge_index_dict))
