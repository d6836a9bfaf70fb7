"""Sampling loaders without PyG's compiled extensions: neighbour sampling in torch
against brute-force neighbourhoods of the same graph, the fixed-size neighbour and
cluster loaders against PyG's own loaders, and the padded edge index staying inside the
padded nodes for every loader and over-size strategy (heterogeneous graphs too)."""
from __future__ import annotations

import pytest
import torch

pyg = pytest.importorskip("torch_geometric")
from torch_geometric.data import Data, HeteroData  # noqa: E402
from torch_geometric.loader import ClusterLoader, NeighborLoader  # noqa: E402

import poptorch  # noqa: E402
import poptorch_geometric as pg  # noqa: E402
from poptorch_geometric import pyg_cluster_loader, pyg_neighbor_loader  # noqa: E402
from poptorch_geometric.samplers.neighbor import TorchNeighborSampler, sample_incoming  # noqa: E402
from poptorch_geometric.samplers.partition import partition_nodes  # noqa: E402

STRATEGIES = [pg.OverSizeStrategy.TrimNodesAndEdges, pg.OverSizeStrategy.TrimNodes,
              pg.OverSizeStrategy.TrimEdges, pg.OverSizeStrategy.Error]


def sizes(strategy: pg.OverSizeStrategy, tight: tuple, roomy: tuple) -> tuple:
    """(nodes, edges): tight where the strategy trims, roomy where it does not."""
    trims_nodes = strategy in (pg.OverSizeStrategy.TrimNodes,
                               pg.OverSizeStrategy.TrimNodesAndEdges)
    trims_edges = strategy in (pg.OverSizeStrategy.TrimEdges,
                               pg.OverSizeStrategy.TrimNodesAndEdges)
    return (tight[0] if trims_nodes else roomy[0], tight[1] if trims_edges else roomy[1])


def graph(num_nodes: int = 60, num_edges: int = 300, seed: int = 0) -> Data:
    gen = torch.Generator().manual_seed(seed)
    edge_index = torch.randint(num_nodes, (2, num_edges), generator=gen)
    return Data(x=torch.randn(num_nodes, 4, generator=gen), edge_index=edge_index,
                edge_attr=torch.randn(num_edges, 2, generator=gen),
                y=torch.randint(3, (num_nodes,), generator=gen))


def hetero_graph(seed: int = 0) -> HeteroData:
    gen = torch.Generator().manual_seed(seed)
    data = HeteroData()
    sizes = {"paper": 40, "author": 25}
    for node_type, n in sizes.items():
        data[node_type].x = torch.randn(n, 3, generator=gen)
    for src, rel, dst, e in (("author", "writes", "paper", 120),
                             ("paper", "cites", "paper", 150),
                             ("paper", "rev", "author", 100)):
        data[src, rel, dst].edge_index = torch.stack([
            torch.randint(sizes[src], (e,), generator=gen),
            torch.randint(sizes[dst], (e,), generator=gen)])
    return data


def incoming(edge_index: torch.Tensor, node: int) -> set[int]:
    """Edge ids (columns) of the edges into ``node``: the brute-force neighbourhood."""
    return set((edge_index[1] == node).nonzero().flatten().tolist())


def test_sampled_edges_are_edges_of_the_graph_with_their_ids():
    data = graph()
    torch.manual_seed(0)
    loader = NeighborLoader(data, [3, 2], batch_size=5,
                            neighbor_sampler=TorchNeighborSampler(data, [3, 2]))
    for batch in loader:
        assert torch.equal(batch.n_id[:5], batch.input_id)  # the seeds come first
        torch.testing.assert_close(data.edge_index[:, batch.e_id],
                                   batch.n_id[batch.edge_index])
        torch.testing.assert_close(batch.x, data.x[batch.n_id])
        torch.testing.assert_close(batch.edge_attr, data.edge_attr[batch.e_id])
        assert batch.num_sampled_nodes[0] == 5 and sum(batch.num_sampled_nodes) == \
            batch.num_nodes
        first_hop = batch.num_sampled_edges[0]
        for seed in range(5):  # hop 1: min(3, in-degree) distinct incoming edges
            chosen = batch.e_id[:first_hop][batch.edge_index[1, :first_hop] == seed]
            assert len(set(chosen.tolist())) == len(chosen)
            assert set(chosen.tolist()) <= incoming(data.edge_index, int(batch.n_id[seed]))
            assert len(chosen) == min(3, len(incoming(data.edge_index,
                                                      int(batch.n_id[seed]))))
        # hop 1's new nodes are exactly the sources found in hop 1 that are not seeds
        sources = set(batch.n_id[batch.edge_index[0, :first_hop]].tolist())
        new = set(batch.n_id[5:5 + batch.num_sampled_nodes[1]].tolist())
        assert new == sources - set(batch.n_id[:5].tolist())


def test_all_neighbours_and_induced_subgraphs_match_brute_force():
    data = graph()
    torch.manual_seed(1)
    sampler = TorchNeighborSampler(data, [-1])
    batch = next(iter(NeighborLoader(data, [-1], batch_size=4, neighbor_sampler=sampler)))
    for seed in range(4):
        assert set(batch.e_id[batch.edge_index[1] == seed].tolist()) == incoming(
            data.edge_index, int(batch.n_id[seed]))
    induced = TorchNeighborSampler(data, [2, 2], subgraph_type="induced")
    batch = next(iter(NeighborLoader(data, [2, 2], batch_size=4,
                                     neighbor_sampler=induced)))
    nodes = set(batch.n_id.tolist())
    expected = {i for i, (s, t) in enumerate(data.edge_index.t().tolist())
                if s in nodes and t in nodes}
    assert set(batch.e_id.tolist()) == expected
    torch.testing.assert_close(data.edge_index[:, batch.e_id],
                               batch.n_id[batch.edge_index])


def test_sample_incoming_is_uniform_and_replace_draws_exactly_k():
    colptr = torch.tensor([0, 10, 12, 12])
    torch.manual_seed(2)
    counts = torch.zeros(10)
    trials = 3000
    for _ in range(trials):
        positions, drawn = sample_incoming(colptr, torch.tensor([0]), 3, replace=False)
        assert drawn.tolist() == [3] and len(set(positions.tolist())) == 3
        counts += torch.bincount(positions, minlength=12)[:10]
    # each of the 10 edges is drawn with probability 0.3 (std of the count ~25)
    assert ((counts - 0.3 * trials).abs() < 150).all()
    positions, drawn = sample_incoming(colptr, torch.tensor([0, 1, 2]), 4, replace=True)
    assert drawn.tolist() == [4, 4, 0]
    assert ((positions[:4] >= 0) & (positions[:4] < 10)).all()
    assert ((positions[4:] >= 10) & (positions[4:] < 12)).all()


def test_heterogeneous_sampling_follows_each_edge_type():
    data = hetero_graph()
    torch.manual_seed(3)
    sampler = TorchNeighborSampler(data, [4, 2])
    loader = NeighborLoader(data, [4, 2], batch_size=6, input_nodes="paper",
                            neighbor_sampler=sampler)
    for batch in loader:
        size = batch["paper"].batch_size
        assert torch.equal(batch["paper"].n_id[:size], batch["paper"].input_id)
        for src, rel, dst in data.edge_types:
            store = batch[src, rel, dst]
            mapped = torch.stack([batch[src].n_id[store.edge_index[0]],
                                  batch[dst].n_id[store.edge_index[1]]])
            torch.testing.assert_close(data[src, rel, dst].edge_index[:, store.e_id], mapped)


def test_unsupported_sampling_names_pyg_lib():
    data = graph()
    with pytest.raises(ImportError, match="pyg-lib"):
        TorchNeighborSampler(data, [2], disjoint=True)


def check_inside(batch) -> None:
    if isinstance(batch, HeteroData):
        for src, rel, dst in batch.edge_types:
            edge_index = batch[src, rel, dst].edge_index
            assert int(edge_index[0].max()) < batch[src].x.shape[0]
            assert int(edge_index[1].max()) < batch[dst].x.shape[0]
            assert int(edge_index.min()) >= 0
    else:
        assert int(batch.edge_index.min()) >= 0
        assert int(batch.edge_index.max()) < batch.x.shape[0] == batch.num_nodes


def real_edges_are_sampled_edges(data: Data, batch) -> None:
    """The real (masked) edges of a padded batch are edges of the graph, by n_id/e_id."""
    e = batch.edges_mask
    torch.testing.assert_close(data.edge_index[:, batch.e_id[e]],
                               batch.n_id[batch.edge_index[:, e]])


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_fixed_size_neighbor_loader_pads_pyg_samples(strategy):
    data = graph()
    nodes, edges = sizes(strategy, (14, 16), (61, 301))
    options = pg.FixedSizeOptions(num_nodes=nodes, num_edges=edges)
    loader = pyg_neighbor_loader.FixedSizeNeighborLoader(
        data, [3, 2], batch_size=4, fixed_size_options=options, over_size_strategy=strategy,
        add_pad_masks=True)
    plain = NeighborLoader(data, [3, 2], batch_size=4,
                           neighbor_sampler=TorchNeighborSampler(data, [3, 2]))
    torch.manual_seed(4)
    padded = list(loader)
    torch.manual_seed(4)
    expected = list(plain)
    assert len(padded) == len(expected) == 15
    trimmed = 0
    for batch, sample in zip(padded, expected, strict=True):
        assert batch.x.shape == (options.num_nodes, 4)
        assert batch.edge_index.shape == (2, options.num_edges)
        check_inside(batch)
        real_edges_are_sampled_edges(data, batch)
        assert batch.batch_size == 4 and torch.equal(batch.input_id, sample.input_id)
        if strategy == pg.OverSizeStrategy.Error:
            n, e = sample.num_nodes, sample.num_edges
            torch.testing.assert_close(batch.x[:n], sample.x)
            torch.testing.assert_close(batch.edge_index[:, :e], sample.edge_index)
            torch.testing.assert_close(batch.n_id[:n], sample.n_id)
        else:
            trimmed += int(batch.nodes_mask.sum()) < sample.num_nodes or \
                int(batch.edges_mask.sum()) < sample.num_edges
    if strategy != pg.OverSizeStrategy.Error:
        assert trimmed > 0  # the sizes are small enough that trimming happened


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_fixed_size_neighbor_loader_heterogeneous(strategy):
    data = hetero_graph()
    nodes, edges = sizes(strategy, ({"paper": 12, "author": 9}, 10),
                         ({"paper": 41, "author": 26}, 151))
    options = pg.FixedSizeOptions(num_nodes=nodes,
                                  num_edges=dict.fromkeys(data.edge_types, edges))
    torch.manual_seed(5)
    loader = pyg_neighbor_loader.FixedSizeNeighborLoader(
        data, [3, 2], batch_size=3, input_nodes="paper", fixed_size_options=options,
        over_size_strategy=strategy, add_pad_masks=True)
    count = 0
    for batch in loader:
        count += 1
        check_inside(batch)
        for node_type, size in options.num_nodes.items():
            assert batch[node_type].x.shape[0] == size
        for edge_type, size in options.num_edges.items():
            assert batch[edge_type].edge_index.shape == (2, size)
            store = batch[edge_type]
            real = store.edges_mask
            src, _, dst = edge_type
            torch.testing.assert_close(
                data[edge_type].edge_index[:, store.e_id[real]],
                torch.stack([batch[src].n_id[store.edge_index[0, real]],
                             batch[dst].n_id[store.edge_index[1, real]]]))
        assert batch["paper"].batch_size == (3 if count < 14 else 1)
    assert count == 14


def test_neighbor_loader_defaults_and_poptorch_version():
    data = graph()
    torch.manual_seed(6)
    loader = pyg_neighbor_loader.FixedSizeNeighborLoader(data, [2], batch_size=4)
    options = loader.fixed_size_options
    assert options.num_graphs == 2 and options.num_nodes > 4
    opts = poptorch.Options().deviceIterations(3)
    fixed = pg.FixedSizeOptions(num_nodes=30, num_edges=40)
    torch.manual_seed(7)
    combined = list(pg.FixedSizeNeighborLoader(data, [3, 2], batch_size=4,
                                               fixed_size_options=fixed, options=opts))
    torch.manual_seed(7)
    plain = list(pyg_neighbor_loader.FixedSizeNeighborLoader(
        data, [3, 2], batch_size=4, fixed_size_options=fixed, add_pad_masks=True))
    assert len(combined) == 5
    for index, batch in enumerate(combined):
        parts = plain[3 * index:3 * index + 3]
        for key in ("x", "edge_index", "n_id", "nodes_mask", "input_id"):
            torch.testing.assert_close(batch[key], torch.cat([p[key] for p in parts]))
        assert batch.num_nodes == 30


def test_partition_without_metis_is_balanced_and_complete():
    data = graph(103, 400)
    parts = partition_nodes(data.edge_index, data.num_nodes, 8)
    sizes = torch.bincount(parts, minlength=8)
    assert sizes.sum() == 103 and int(sizes.max() - sizes.min()) <= 1
    cluster_data = pyg_cluster_loader.ClusterData(data, num_parts=8, log=False)
    assert len(cluster_data) == 8
    assert sum(cluster_data[i].num_nodes for i in range(8)) == 103
    # a breadth-first order keeps neighbours together: more edges inside parts than a
    # random balanced partition of the same sizes keeps
    inside = (parts[data.edge_index[0]] == parts[data.edge_index[1]]).float().mean()
    gen = torch.Generator().manual_seed(0)
    shuffled = parts[torch.randperm(103, generator=gen)]
    random_inside = (shuffled[data.edge_index[0]] ==
                     shuffled[data.edge_index[1]]).float().mean()
    assert inside > random_inside


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_fixed_size_cluster_loader_pads_pyg_cluster_batches(strategy):
    data = graph(96, 500)
    cluster_data = pyg_cluster_loader.ClusterData(data, num_parts=8, log=False)
    nodes, edges = sizes(strategy, (20, 30), (40, 300))
    options = pg.FixedSizeOptions(num_nodes=nodes, num_edges=edges)
    torch.manual_seed(8)
    loader = pyg_cluster_loader.FixedSizeClusterLoader(
        cluster_data, options, batch_size=2, over_size_strategy=strategy)
    reference = list(ClusterLoader(cluster_data, batch_size=2))
    batches = list(loader)
    assert len(batches) == len(reference) == 4
    for batch, expected in zip(batches, reference, strict=True):
        assert batch.x.shape == (options.num_nodes, 4)
        assert batch.edge_index.shape == (2, options.num_edges)
        check_inside(batch)
        if strategy == pg.OverSizeStrategy.Error:
            n, e = expected.num_nodes, expected.num_edges
            torch.testing.assert_close(batch.x[:n], expected.x)
            torch.testing.assert_close(batch.edge_index[:, :e], expected.edge_index)
            assert not batch.nodes_mask[n:].any() and batch.nodes_mask[:n].all()
    opts = poptorch.Options().deviceIterations(2)
    combined = list(pg.FixedSizeClusterLoader(cluster_data, options, batch_size=2,
                                              over_size_strategy=strategy, options=opts))
    assert len(combined) == 2
    if strategy == pg.OverSizeStrategy.Error:
        torch.testing.assert_close(combined[0].x, torch.cat([batches[0].x, batches[1].x]))
    for batch in combined:
        for part in torch.split(batch.edge_index, 2):
            assert int(part.max()) < options.num_nodes
