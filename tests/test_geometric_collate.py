"""poptorch_geometric's collaters against PyG's own batching of the same graphs: the real
part of a fixed-size batch is PyG's batch, the rest is padding that only connects
padding nodes; trimming, over-size errors and combined (multi-micro-batch) batches."""
from __future__ import annotations

import pytest
import torch

pyg = pytest.importorskip("torch_geometric")
from torch_geometric.data import Batch, Data, HeteroData  # noqa: E402

import poptorch  # noqa: E402
import poptorch_geometric as pg  # noqa: E402
from poptorch_geometric.collate import make_exclude_keys  # noqa: E402


def graphs(count: int, seed: int = 0, edge_dim: int = 3) -> list[Data]:
    """Random graphs of 1-8 nodes, 0-20 edges, graph-level labels and a name."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(count):
        n = int(torch.randint(1, 9, (), generator=gen))
        e = int(torch.randint(0, 21, (), generator=gen))
        out.append(Data(x=torch.randn(n, 4, generator=gen),
                        edge_index=torch.randint(n, (2, e), generator=gen),
                        edge_attr=torch.randn(e, edge_dim, generator=gen),
                        y=torch.randint(3, (1,), generator=gen), name=f"g{i}"))
    return out


def hetero_graphs(count: int, seed: int = 0) -> list[HeteroData]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        data = HeteroData()
        sizes = {"a": int(torch.randint(1, 7, (), generator=gen)),
                 "b": int(torch.randint(1, 5, (), generator=gen))}
        for node_type, n in sizes.items():
            data[node_type].x = torch.randn(n, 3, generator=gen)
        for src, dst in (("a", "b"), ("b", "a"), ("a", "a")):
            e = int(torch.randint(0, 9, (), generator=gen))
            data[src, "to", dst].edge_index = torch.stack([
                torch.randint(sizes[src], (e,), generator=gen),
                torch.randint(sizes[dst], (e,), generator=gen)])
            data[src, "to", dst].edge_attr = torch.randn(e, 2, generator=gen)
        data.y = torch.randint(3, (1,), generator=gen)
        out.append(data)
    return out


def assert_padding_is_isolated(batch: Batch, num_real_nodes: int) -> None:
    """Edge indices lie within the batch's nodes, and an edge touches a padding node only
    if both its ends are padding nodes (padding never reaches a real node)."""
    edge_index = batch.edge_index
    assert int(edge_index.max()) < batch.num_nodes and int(edge_index.min()) >= 0
    padding_end = edge_index >= num_real_nodes
    assert torch.equal(padding_end[0], padding_end[1])


@pytest.mark.parametrize("num_graphs,real", [(2, 1), (5, 4), (6, 3)])
def test_pad_to_max_matches_pyg_batch_and_pads(num_graphs, real):
    data_list = graphs(real)
    options = pg.FixedSizeOptions(num_nodes=60, num_edges=120, num_graphs=num_graphs,
                                  node_pad_value=-1.0, edge_pad_value=-2.0,
                                  graph_pad_value=-3.0)
    batch = pg.FixedSizeCollater(options, add_masks_to_batch=True)(list(data_list))
    reference = Batch.from_data_list(data_list)
    n, e = reference.num_nodes, reference.num_edges

    assert batch.x.shape == (60, 4) and batch.edge_index.shape == (2, 120)
    assert batch.edge_attr.shape == (120, 3) and batch.batch.shape == (60,)
    assert batch.num_graphs == num_graphs and batch.y.shape == (num_graphs,)
    torch.testing.assert_close(batch.x[:n], reference.x)
    torch.testing.assert_close(batch.edge_index[:, :e], reference.edge_index)
    torch.testing.assert_close(batch.edge_attr[:e], reference.edge_attr)
    torch.testing.assert_close(batch.batch[:n], reference.batch)
    torch.testing.assert_close(batch.y[:real], reference.y)
    assert (batch.x[n:] == -1.0).all() and (batch.edge_attr[e:] == -2.0).all()
    assert (batch.y[real:] == -3).all()
    assert batch.name[:real] == reference.name and batch.name[real:] == ["g0"] * (
        num_graphs - real)
    assert torch.equal(batch.graphs_mask, torch.arange(num_graphs) < real)
    assert torch.equal(batch.nodes_mask, torch.arange(60) < n)
    assert torch.equal(batch.edges_mask, torch.arange(120) < e)
    # padding nodes belong to padding graphs only
    assert (batch.batch[n:] >= real).all()
    assert_padding_is_isolated(batch, n)


def test_padding_edges_go_only_to_padding_graphs_with_nodes():
    """3 padding graphs but 2 padding nodes: the padding graph without a node gets no
    edge (its edges would point past the batch's nodes)."""
    data_list = graphs(2)
    real_nodes = sum(d.num_nodes for d in data_list)
    options = pg.FixedSizeOptions(num_nodes=real_nodes + 2, num_edges=50, num_graphs=5)
    batch = pg.FixedSizeCollater(options)(data_list)
    assert batch.num_graphs == 5 and batch.edge_index.shape == (2, 50)
    assert_padding_is_isolated(batch, real_nodes)
    assert torch.bincount(batch.batch, minlength=5)[2:].tolist() == [1, 1, 0]


def test_no_padding_node_for_padding_edges_is_an_error():
    data_list = graphs(2)
    real_nodes = sum(d.num_nodes for d in data_list)
    options = pg.FixedSizeOptions(num_nodes=real_nodes, num_edges=100, num_graphs=3)
    with pytest.raises(RuntimeError, match="no padding node"):
        pg.FixedSizeCollater(options)(data_list)


@pytest.mark.parametrize("what,nodes,edges", [("nodes", 5, 1000), ("edges", 1000, 5)])
def test_over_size_is_an_error_naming_what_does_not_fit(what, nodes, edges):
    options = pg.FixedSizeOptions(num_nodes=nodes, num_edges=edges, num_graphs=5)
    with pytest.raises(RuntimeError, match=f"don't allocate enough space for the number "
                                           f"of {what}"):
        pg.FixedSizeCollater(options)(graphs(4))
    with pytest.raises(RuntimeError, match="maximum number of graphs"):
        pg.FixedSizeCollater(pg.FixedSizeOptions(num_nodes=500, num_graphs=3))(graphs(4))
    with pytest.raises(TypeError, match="Expected list, got tuple"):
        pg.FixedSizeCollater(options)(tuple(graphs(2)))


def test_node_level_labels_and_a_graph_of_one_node():
    """A one-node first graph makes a graph-level label look node-level: the other
    graphs decide; node-level labels are padded per node."""
    first = Data(x=torch.randn(1, 2), edge_index=torch.zeros(2, 0, dtype=torch.long),
                 y=torch.tensor([7]))
    second = Data(x=torch.randn(3, 2), edge_index=torch.tensor([[0, 1], [1, 2]]),
                  y=torch.tensor([8]))
    batch = pg.FixedSizeCollater(pg.FixedSizeOptions(num_nodes=10, num_edges=6,
                                                     num_graphs=3))([first, second])
    assert batch.y.tolist() == [7, 8, 0]
    node_labelled = [Data(x=torch.randn(n, 2), y=torch.arange(n)) for n in (2, 3)]
    batch = pg.FixedSizeCollater(pg.FixedSizeOptions(num_nodes=8, num_edges=4,
                                                     num_graphs=3))(node_labelled)
    assert batch.y.tolist() == [0, 1, 0, 1, 2, 0, 0, 0]


def test_pad_graph_defaults_and_non_tensor_values():
    data_list = graphs(2)
    for data in data_list:
        data.scalar = 2
    options = pg.FixedSizeOptions(num_nodes=40, num_edges=60, num_graphs=4,
                                  pad_graph_defaults={"name": "pad", "scalar": 3})
    batch = pg.FixedSizeCollater(options)(data_list)
    assert batch.name == ["g0", "g1", "pad", "pad"]
    assert batch.scalar.tolist() == [2, 2, 3, 3]


def test_heterogeneous_batch_matches_pyg_per_type_and_pads_per_type():
    data_list = hetero_graphs(3)
    num_nodes = {"a": 30, "b": 20}
    num_edges = dict.fromkeys(data_list[0].edge_types, 40)
    options = pg.FixedSizeOptions(num_nodes=num_nodes, num_edges=num_edges, num_graphs=4,
                                  node_pad_value=5.0)
    batch = pg.FixedSizeCollater(options, add_masks_to_batch=True)(data_list)
    reference = Batch.from_data_list(data_list)
    for node_type, size in num_nodes.items():
        n = reference[node_type].num_nodes
        assert batch[node_type].x.shape == (size, 3) and batch[node_type].num_nodes == size
        torch.testing.assert_close(batch[node_type].x[:n], reference[node_type].x)
        assert (batch[node_type].x[n:] == 5.0).all()
        assert torch.equal(batch[node_type].nodes_mask, torch.arange(size) < n)
    for edge_type, size in num_edges.items():
        src, _, dst = edge_type
        e = reference[edge_type].num_edges
        edge_index = batch[edge_type].edge_index
        assert edge_index.shape == (2, size)
        torch.testing.assert_close(edge_index[:, :e], reference[edge_type].edge_index)
        assert int(edge_index[0].max()) < num_nodes[src]
        assert int(edge_index[1].max()) < num_nodes[dst]
        assert (edge_index[0, e:] >= reference[src].num_nodes).all()
        assert (edge_index[1, e:] >= reference[dst].num_nodes).all()
        assert torch.equal(batch[edge_type].edges_mask, torch.arange(size) < e)
    assert batch.num_nodes == sum(num_nodes.values())
    assert batch.num_edges == sum(num_edges.values())
    assert batch.y.shape == (4,) and torch.equal(batch.graphs_mask,
                                                  torch.tensor([True] * 3 + [False]))


def test_single_sizes_become_per_type_for_heterogeneous_graphs():
    options = pg.FixedSizeOptions(num_nodes=40, num_edges=50, num_graphs=3)
    batch = pg.FixedSizeCollater(options)(hetero_graphs(2))
    assert options.is_hetero() and options.num_nodes == {"a": 40, "b": 40}
    assert all(batch[t].num_nodes == 40 for t in ("a", "b"))
    assert all(batch[t].edge_index.shape == (2, 50) for t in batch.edge_types)
    with pytest.raises(ValueError, match="exist in the data but not in the fixed size"):
        pg.FixedSizeCollater(pg.FixedSizeOptions(
            num_nodes={"a": 40}, num_edges=dict.fromkeys(batch.edge_types, 50)))(
                hetero_graphs(1))


def _edges_of(data: Data) -> set[tuple]:
    """Edges as (source features, target features): survives renumbering."""
    return {(tuple(data.x[s].tolist()), tuple(data.x[t].tolist()))
            for s, t in data.edge_index.t().tolist()}


@pytest.mark.parametrize("trim_nodes,trim_edges", [(True, False), (False, True),
                                                   (True, True)])
def test_trimming_keeps_subgraphs_of_the_real_graphs(trim_nodes, trim_edges):
    torch.manual_seed(1)
    data_list = graphs(6)
    options = pg.FixedSizeOptions(num_nodes=15 if trim_nodes else 200,
                                  num_edges=25 if trim_edges else 400, num_graphs=7)
    collater = pg.FixedSizeCollater(options, add_masks_to_batch=True, trim_nodes=trim_nodes,
                                    trim_edges=trim_edges)
    batch = collater(list(data_list))
    real = int(batch.nodes_mask.sum())
    assert batch.x.shape[0] == options.num_nodes
    assert batch.edge_index.shape == (2, options.num_edges)
    if trim_nodes:
        assert real == options.num_nodes - 1  # one node left for the padding graph
    assert_padding_is_isolated(batch, real)
    # every graph keeps a node; every kept edge is an edge of its original graph
    counts = torch.bincount(batch.batch[:real], minlength=7)[:6]
    assert (counts >= 1).all()
    real_edges = int(batch.edges_mask.sum())
    ends = batch.edge_index[:, :real_edges]
    for index, original in enumerate(data_list):
        mine = ends[:, batch.batch[ends[0]] == index]
        kept = Data(x=batch.x, edge_index=mine)
        assert _edges_of(kept) <= _edges_of(original)
        # nodes kept are nodes of the original graph
        assert {tuple(r) for r in batch.x[:real][batch.batch[:real] == index].tolist()} <= {
            tuple(r) for r in original.x.tolist()}


def test_trimming_heterogeneous_graphs_per_type():
    torch.manual_seed(2)
    data_list = hetero_graphs(5)
    num_nodes = {"a": 8, "b": 7}
    num_edges = dict.fromkeys(data_list[0].edge_types, 6)
    options = pg.FixedSizeOptions(num_nodes=num_nodes, num_edges=num_edges, num_graphs=6)
    batch = pg.FixedSizeCollater(options, add_masks_to_batch=True, trim_nodes=True,
                                 trim_edges=True)(data_list)
    for node_type, size in num_nodes.items():
        assert batch[node_type].x.shape[0] == size
        assert int(batch[node_type].nodes_mask.sum()) == size - 1
    for (src, _, dst), size in num_edges.items():
        edge_index = batch[src, "to", dst].edge_index
        assert edge_index.shape == (2, size)
        assert int(edge_index[0].max()) < num_nodes[src]
        assert int(edge_index[1].max()) < num_nodes[dst]


def test_trimming_to_fewer_nodes_than_graphs_is_an_error():
    options = pg.FixedSizeOptions(num_nodes=2, num_graphs=4)
    with pytest.raises(RuntimeError, match="less than the number of graphs"):
        pg.FixedSizeCollater(options, trim_nodes=True)(graphs(3))


def test_skip_over_size_leaves_out_graphs_that_do_not_fit():
    data_list = graphs(5)
    sizes = [d.num_nodes for d in data_list]
    limit = sizes[0] + sizes[1] + 1
    options = pg.FixedSizeOptions(num_nodes=limit, num_edges=500, num_graphs=6)
    batch = pg.FixedSizeCollater(options, add_masks_to_batch=True,
                                 skip_over_size=True)(data_list)
    kept = []
    used = 0
    for data in data_list:
        if used + data.num_nodes < limit:
            kept.append(data)
            used += data.num_nodes
    reference = Batch.from_data_list(kept)
    assert int(batch.graphs_mask.sum()) == len(kept)
    torch.testing.assert_close(batch.x[:used], reference.x)
    assert batch.x.shape[0] == limit


def test_combined_batching_collater_joins_micro_batches_like_torch_cat():
    data_list = graphs(8)
    options = pg.FixedSizeOptions(num_nodes=50, num_edges=100, num_graphs=3)
    collater = pg.CombinedBatchingCollater(pg.FixedSizeCollater(options), mini_batch_size=2)
    combined = collater(list(data_list))
    parts = [pg.FixedSizeCollater(options)(data_list[i:i + 2]) for i in range(0, 8, 2)]
    for key in ("x", "edge_index", "edge_attr", "batch", "ptr", "y"):
        torch.testing.assert_close(combined[key], torch.cat([p[key] for p in parts]))
    assert combined.edge_index.shape == (8, 100)
    assert combined.num_nodes == 50 and combined.num_graphs == 3
    with pytest.raises(AssertionError, match="Invalid batch size"):
        collater(data_list[:7])
    # heterogeneous: each node store keeps one micro-batch's count
    hetero = hetero_graphs(4)
    hetero_options = pg.FixedSizeOptions(num_nodes={"a": 20, "b": 20},
                                         num_edges=dict.fromkeys(hetero[0].edge_types, 20),
                                         num_graphs=3)
    joined = pg.CombinedBatchingCollater(pg.FixedSizeCollater(hetero_options), 2)(hetero)
    assert joined["a"].x.shape[0] == 40 and joined["a"].num_nodes == 20
    assert joined.num_nodes == 40 and joined.num_edges == 60


def test_combine_batch_tensors_gen_concatenates_position_by_position():
    from poptorch._utils import combine_batch_tensors_gen
    first = [torch.ones(2, 3), torch.zeros(1)]
    second = [torch.full((1, 3), 2.0), torch.ones(2)]
    out = list(combine_batch_tensors_gen([first, second]))
    torch.testing.assert_close(out[0], torch.cat([first[0], second[0]]))
    torch.testing.assert_close(out[1], torch.cat([first[1], second[1]]))
    with pytest.raises(poptorch.Error, match="different numbers of tensors"):
        list(combine_batch_tensors_gen([first, second[:1]]))


def test_make_exclude_keys_and_the_plain_collater():
    data = graphs(1)[0]
    exclude = make_exclude_keys(("x", "y"), data)
    assert set(exclude) == {"edge_index", "edge_attr", "name"}
    batch = pg.collate.Collater(exclude_keys=exclude)([data, data])
    reference = Batch.from_data_list([data, data], exclude_keys=list(exclude))
    assert set(batch.keys()) == set(reference.keys())
    torch.testing.assert_close(batch.x, reference.x)


def test_as_many_nodes_as_edges_keeps_e_id_edge_level():
    """With as many nodes as edges sizes cannot tell ``e_id`` (edge ids of a sampled
    graph) from a node attribute; trimming and padding keep it with the edges."""
    data = Data(x=torch.randn(4, 2), edge_index=torch.tensor([[0, 1, 2, 3], [1, 2, 3, 0]]),
                e_id=torch.tensor([10, 11, 12, 13]), n_id=torch.tensor([5, 6, 7, 8]))
    torch.manual_seed(3)
    options = pg.FixedSizeOptions(num_nodes=6, num_edges=2)
    batch = pg.FixedSizeCollater(options, trim_edges=True, add_masks_to_batch=True)([data])
    assert batch.e_id.shape == (2,) and batch.n_id.shape == (6,)
    kept = batch.e_id[batch.edges_mask] - 10
    torch.testing.assert_close(batch.edge_index[:, batch.edges_mask],
                               data.edge_index[:, kept])
    options = pg.FixedSizeOptions(num_nodes=3, num_edges=9)
    torch.manual_seed(4)
    batch = pg.FixedSizeCollater(options, trim_nodes=True, add_masks_to_batch=True)([data])
    real = int(batch.edges_mask.sum())
    assert batch.e_id.shape == (9,) and batch.n_id.shape == (3,)
    ends = batch.n_id[batch.edge_index[:, :real]] - 5
    torch.testing.assert_close(ends, data.edge_index[:, batch.e_id[:real] - 10])


def test_a_collater_relearns_levels_a_batch_contradicts():
    """Levels learnt from one batch are checked on the next padded batch: labels that
    were per node there and are per graph here are padded per graph."""
    collater = pg.FixedSizeCollater(pg.FixedSizeOptions(num_nodes=20, num_edges=10,
                                                        num_graphs=3))
    node_labels = [Data(x=torch.randn(n, 2), edge_index=torch.zeros(2, 0, dtype=torch.long),
                        y=torch.arange(n)) for n in (3, 4)]
    assert collater(node_labels).y.shape == (20,)
    graph_labels = [Data(x=torch.randn(n, 2), edge_index=torch.zeros(2, 0, dtype=torch.long),
                         y=torch.tensor([n])) for n in (3, 4)]
    batch = collater(graph_labels)
    assert batch.y.tolist() == [3, 4, 0] and batch.x.shape == (20, 2)


# -- the one-pass batching of plain Data graphs against the previous semantics --------

def varied_graphs(count: int, seed: int) -> list[Data]:
    """Random graphs with every kind of attribute the one-pass batching handles: node,
    edge and graph-level tensors, 0-dimensional values, node indices of several dtypes
    (``face``, an int32 ``*_index``), a boolean node mask, Python numbers and
    strings."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(count):
        n = int(torch.randint(1, 12, (), generator=gen))
        e = int(torch.randint(0, 30, (), generator=gen))
        out.append(Data(
            x=torch.randn(n, 3, generator=gen),
            edge_index=torch.randint(n, (2, e), generator=gen),
            edge_attr=torch.randn(e, 2, generator=gen).double(),
            pos=torch.randn(n, 2, generator=gen),
            node_label=torch.randint(5, (n,), generator=gen),
            mask=torch.rand(n, generator=gen) > 0.5,
            y=torch.randint(3, (1,), generator=gen),
            score=torch.randn((), generator=gen),
            face=torch.randint(n, (3, 2), generator=gen),
            anchor_index=torch.randint(n, (4,), generator=gen, dtype=torch.int32),
            weight=float(i) / 2, count=i, name=f"g{i}"))
    return out


def _previous(monkeypatch: pytest.MonkeyPatch, collater: pg.FixedSizeCollater,
              data_list: list[Data]) -> Batch:
    """What the collater gave before the one-pass batching: PyG's ``Batch.from_data_list``
    of the graphs and their padding graphs."""
    with monkeypatch.context() as patch:
        patch.setattr(pg.collate, "padded_batch", lambda *args, **kwargs: None)
        return collater(list(data_list))


def assert_same_batch(actual: Batch, expected: Batch) -> None:
    """Same keys in the same order, equal values of equal dtypes, the same slices,
    increments and number of graphs (so that ``to_data_list`` gives the same graphs)."""
    assert type(actual) is type(expected)
    assert list(actual.stores[0].keys()) == list(expected.stores[0].keys())
    for key, value in expected.stores[0].items():
        mine = actual[key]
        if isinstance(value, torch.Tensor):
            assert mine.dtype == value.dtype and torch.equal(mine, value), key
        else:
            assert mine == value, key
    assert actual.num_graphs == expected.num_graphs
    for attribute in ("_slice_dict", "_inc_dict"):
        mine_dict, their_dict = getattr(actual, attribute), getattr(expected, attribute)
        assert list(mine_dict) == list(their_dict)
        for key, value in their_dict.items():
            if value is None:
                assert mine_dict[key] is None, (attribute, key)
            else:
                assert mine_dict[key].dtype == value.dtype, (attribute, key)
                assert torch.equal(mine_dict[key], value), (attribute, key)
    for mine_graph, their_graph in zip(actual.to_data_list(), expected.to_data_list(),
                                       strict=True):
        assert list(mine_graph.keys()) == list(their_graph.keys())
        for key, value in their_graph.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(mine_graph[key], value), key
            else:
                assert mine_graph[key] == value, key


@pytest.mark.parametrize("seed", range(6))
def test_one_pass_batching_equals_pyg_batching_of_graphs_and_padding(monkeypatch, seed):
    """On random graphs, padding graphs and fixed sizes: the same padded tensors, masks,
    batch vectors, slices and increments as PyG's batching of the graphs and padding
    graphs; and the one-pass path did batch them."""
    gen = torch.Generator().manual_seed(100 + seed)
    real = int(torch.randint(1, 9, (), generator=gen))
    num_graphs = real + int(torch.randint(1, 4, (), generator=gen))
    data_list = varied_graphs(real, seed)
    nodes = sum(d.num_nodes for d in data_list)
    edges = sum(d.num_edges for d in data_list)
    options = pg.FixedSizeOptions(
        num_nodes=nodes + int(torch.randint(1, 6, (), generator=gen)),
        num_edges=edges + int(torch.randint(0, 9, (), generator=gen)),
        num_graphs=num_graphs, node_pad_value=-1.0, edge_pad_value=-2.0,
        graph_pad_value=-3.0, pad_graph_defaults={"name": "pad", "weight": 9.5})
    follow = ["x", "edge_attr", "name"] if seed % 2 else []
    exclude = ["pos"] if seed % 3 == 0 else []
    collater = pg.FixedSizeCollater(options, add_masks_to_batch=True, follow_batch=follow,
                                    exclude_keys=exclude)
    one_pass = []
    real_padded_batch = pg.collate.padded_batch

    def spy(*args, **kwargs):
        one_pass.append(real_padded_batch(*args, **kwargs))
        return one_pass[-1]

    monkeypatch.setattr(pg.collate, "padded_batch", spy)
    batch = collater(list(data_list))
    assert one_pass and one_pass[-1] is not None
    previous = _previous(monkeypatch, pg.FixedSizeCollater(
        options, add_masks_to_batch=True, follow_batch=follow, exclude_keys=exclude),
        data_list)
    assert_same_batch(batch, previous)
    # and the real part is PyG's batch of the real graphs
    reference = Batch.from_data_list(data_list, follow_batch=follow, exclude_keys=exclude)
    assert torch.equal(batch.x[:nodes], reference.x)
    assert torch.equal(batch.edge_index[:, :edges], reference.edge_index)
    assert torch.equal(batch.batch[:nodes], reference.batch)
    assert torch.equal(batch.face[:, :2 * real], reference.face)
    assert torch.equal(batch.nodes_mask, torch.arange(options.num_nodes) < nodes)
    assert torch.equal(batch.edges_mask, torch.arange(options.num_edges) < edges)
    assert torch.equal(batch.graphs_mask, torch.arange(num_graphs) < real)
    assert batch.name[real:] == ["pad"] * (num_graphs - real)
    assert_padding_is_isolated(batch, nodes)


@pytest.mark.parametrize("case", ["subclass", "num_nodes", "batch_key", "index_number",
                                  "tensor_list", "bool_index"])
def test_graphs_the_one_pass_batching_leaves_to_pyg(monkeypatch, case):
    """Graphs whose batching PyG decides in ways the one-pass path does not follow go
    to PyG, with the same results as before."""
    class MyData(Data):
        pass

    data_list = graphs(3)
    if case == "subclass":
        data_list = [MyData(**dict(d.items())) for d in data_list]
    for data in data_list:
        if case == "num_nodes":
            data.num_nodes = data.x.shape[0]
        elif case == "batch_key":
            data.sub_batch = torch.zeros(data.x.shape[0], dtype=torch.long)
        elif case == "index_number":
            data.root_index = 0
        elif case == "tensor_list":
            data.parts = [torch.ones(2), torch.zeros(3)]
        elif case == "bool_index":  # PyG's shift makes it int64
            data.flag_index = torch.ones(2, dtype=torch.bool)
    options = pg.FixedSizeOptions(num_nodes=60, num_edges=80, num_graphs=5)
    results = []
    real_padded_batch = pg.collate.padded_batch

    def spy(*args, **kwargs):
        results.append(real_padded_batch(*args, **kwargs))
        return results[-1]

    monkeypatch.setattr(pg.collate, "padded_batch", spy)
    batch = pg.FixedSizeCollater(options, add_masks_to_batch=True)(list(data_list))
    assert results == [None]
    previous = _previous(monkeypatch, pg.FixedSizeCollater(options, add_masks_to_batch=True),
                         data_list)
    for key, value in previous.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(batch[key], value), key
