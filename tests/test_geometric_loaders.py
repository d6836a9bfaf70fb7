"""Fixed-size data loaders against PyG's DataLoader on the same data: PadToMax and
StreamPack, the OverSizeStrategy modes, the poptorch.DataLoader versions (micro-batches
of one call joined), heterogeneous graphs, StreamPackingSampler and FixedSizeOptions."""
from __future__ import annotations

import pytest
import torch

pyg = pytest.importorskip("torch_geometric")
from torch_geometric.data import Batch, Data, HeteroData  # noqa: E402
from torch_geometric.loader import DataLoader as PyGLoader  # noqa: E402

import poptorch  # noqa: E402
import poptorch_geometric as pg  # noqa: E402
from poptorch_geometric import pyg_dataloader  # noqa: E402


def dataset(count: int = 30, seed: int = 0) -> list[Data]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        n = int(torch.randint(2, 12, (), generator=gen))
        e = int(torch.randint(1, 3 * n, (), generator=gen))
        out.append(Data(x=torch.randn(n, 5, generator=gen),
                        edge_index=torch.randint(n, (2, e), generator=gen),
                        edge_attr=torch.randn(e, 2, generator=gen),
                        y=torch.randint(4, (1,), generator=gen)))
    return out


def hetero_dataset(count: int = 12, seed: int = 0) -> list[HeteroData]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        data = HeteroData()
        sizes = {"u": int(torch.randint(1, 6, (), generator=gen)),
                 "v": int(torch.randint(1, 6, (), generator=gen))}
        for node_type, n in sizes.items():
            data[node_type].x = torch.randn(n, 3, generator=gen)
        for src, dst in (("u", "v"), ("v", "u")):
            e = int(torch.randint(1, 8, (), generator=gen))
            data[src, "e", dst].edge_index = torch.stack([
                torch.randint(sizes[src], (e,), generator=gen),
                torch.randint(sizes[dst], (e,), generator=gen)])
        data.y = torch.randint(2, (1,), generator=gen)
        out.append(data)
    return out


def check_edge_index_inside(batch: Batch) -> None:
    """Every padded batch keeps its edge index inside its padded node count (per type)."""
    if isinstance(batch, HeteroData):
        for (src, _, dst) in batch.edge_types:
            edge_index = batch[src, _, dst].edge_index
            if edge_index.numel():
                assert int(edge_index[0].max()) < batch[src].num_nodes
                assert int(edge_index[1].max()) < batch[dst].num_nodes
                assert int(edge_index.min()) >= 0
        return
    assert int(batch.edge_index.min()) >= 0 and int(batch.edge_index.max()) < batch.num_nodes
    assert int(batch.edge_index.max()) < batch.x.shape[0]


def real_part(batch: Batch) -> Batch:
    """The real graphs of a masked fixed-size batch, as a PyG batch."""
    real = int(batch.graphs_mask.sum())
    n, e = int(batch.nodes_mask.sum()), int(batch.edges_mask.sum())
    return Batch(x=batch.x[:n], edge_index=batch.edge_index[:, :e],
                 edge_attr=batch.edge_attr[:e], y=batch.y[:real], batch=batch.batch[:n])


def assert_same_graphs(actual: Batch, expected: Batch) -> None:
    for key in ("x", "edge_index", "edge_attr", "y", "batch"):
        torch.testing.assert_close(actual[key], expected[key])


def test_pad_to_max_batches_are_pyg_batches_plus_padding():
    data = dataset()
    options = pg.FixedSizeOptions(num_nodes=60, num_edges=200, num_graphs=5)
    loader = pyg_dataloader.FixedSizeDataLoader(data, batch_size=5,
                                                fixed_size_options=options)
    reference = list(PyGLoader(data, batch_size=4))
    batches = list(loader)
    assert len(batches) == len(reference)
    for batch, expected in zip(batches, reference, strict=True):
        assert batch.x.shape == (60, 5) and batch.edge_index.shape == (2, 200)
        assert batch.num_graphs == 5
        assert_same_graphs(real_part(batch), expected)
        check_edge_index_inside(batch)


def test_worker_processes_give_the_batches_of_the_main_process():
    """Batches collated in a worker process (written into shared memory there) equal
    those collated in the main process, and their real part is PyG's batch."""
    data = dataset(24, seed=3)
    options = pg.FixedSizeOptions(num_nodes=60, num_edges=200, num_graphs=5)
    main = list(pyg_dataloader.FixedSizeDataLoader(data, batch_size=5,
                                                   fixed_size_options=options))
    workers = list(pyg_dataloader.FixedSizeDataLoader(data, batch_size=5,
                                                      fixed_size_options=options,
                                                      num_workers=1))
    reference = list(PyGLoader(data, batch_size=4))
    assert len(main) == len(workers) == len(reference)
    for mine, theirs, expected in zip(workers, main, reference, strict=True):
        assert list(mine.keys()) == list(theirs.keys())
        for key, value in theirs.items():
            if isinstance(value, torch.Tensor):
                assert mine[key].dtype == value.dtype and torch.equal(mine[key], value)
        assert_same_graphs(real_part(mine), expected)


def test_default_fixed_sizes_fit_any_batch():
    data = dataset()
    loader = pyg_dataloader.FixedSizeDataLoader(data, batch_size=4)
    options = loader.fixed_size_options
    assert options.num_nodes == max(d.num_nodes for d in data) * 3 + 1
    assert options.num_edges == max(d.num_edges for d in data) * 3 + 1
    assert sum(int(b.graphs_mask.sum()) for b in loader) == len(data)
    with pytest.raises(ValueError, match="must match provided batch size"):
        pyg_dataloader.FixedSizeDataLoader(data, batch_size=4, fixed_size_options=options.__class__(
            num_nodes=50, num_graphs=3))
    with pytest.raises(TypeError, match="Cannot set `collate_fn`"):
        pyg_dataloader.FixedSizeDataLoader(data, batch_size=4, collate_fn=list)


def test_stream_pack_takes_every_graph_once_in_order_in_fixed_sizes():
    data = dataset()
    options = pg.FixedSizeOptions(num_nodes=40, num_edges=120, num_graphs=8)
    loader = pyg_dataloader.FixedSizeDataLoader(
        data, batch_size=8, fixed_size_options=options,
        fixed_size_strategy=pg.FixedSizeStrategy.StreamPack)
    seen = []
    for batch in loader:
        assert batch.x.shape == (40, 5) and batch.edge_index.shape == (2, 120)
        assert batch.num_graphs == 8 and batch.ptr.shape == (9,)
        check_edge_index_inside(batch)
        part = real_part(batch)
        seen.extend(_split(part))
    expected = Batch.from_data_list(data)
    replay = Batch.from_data_list(seen)
    for key in ("x", "edge_index", "edge_attr", "y"):
        torch.testing.assert_close(replay[key], expected[key])


def _split(part: Batch) -> list[Data]:
    """The graphs of ``part`` (x, edges, labels) from its batch vector."""
    out = []
    for graph in range(len(part.y)):
        nodes = (part.batch == graph).nonzero().flatten()
        first = int(nodes[0])
        edges = part.batch[part.edge_index[0]] == graph
        out.append(Data(x=part.x[nodes], edge_index=part.edge_index[:, edges] - first,
                        edge_attr=part.edge_attr[edges], y=part.y[graph:graph + 1]))
    return out


@pytest.mark.parametrize("strategy", [pg.FixedSizeStrategy.PadToMax,
                                      pg.FixedSizeStrategy.StreamPack])
def test_over_size_error_skip_and_trim(strategy):
    data = dataset()
    big = Data(x=torch.randn(50, 5), edge_index=torch.randint(50, (2, 60)),
               edge_attr=torch.randn(60, 2), y=torch.tensor([1]))
    data = [*data[:5], big, *data[5:10]]
    options = pg.FixedSizeOptions(num_nodes=45, num_edges=150, num_graphs=4)
    make = pyg_dataloader.FixedSizeDataLoader
    with pytest.raises(RuntimeError):
        list(make(data, batch_size=4, fixed_size_options=options,
                  fixed_size_strategy=strategy))
    skipped = list(make(data, batch_size=4, fixed_size_options=options,
                        fixed_size_strategy=strategy,
                        over_size_strategy=pg.OverSizeStrategy.Skip))
    total = sum(int(b.graphs_mask.sum()) for b in skipped)
    assert total == len(data) - 1  # the big graph alone was left out
    assert all(not torch.equal(b.x[:50], big.x) for b in skipped)
    for over in (pg.OverSizeStrategy.TrimNodes, pg.OverSizeStrategy.TrimNodesAndEdges,
                 pg.OverSizeStrategy.TrimEdges):
        torch.manual_seed(0)
        loader = make(data, batch_size=4, fixed_size_options=options,
                      fixed_size_strategy=strategy, over_size_strategy=over)
        if strategy == pg.FixedSizeStrategy.StreamPack:
            # the packer never takes a graph larger than a batch, trimming or not
            with pytest.raises(RuntimeError, match="too small to fit in the single sample"):
                list(loader)
            continue
        if over == pg.OverSizeStrategy.TrimEdges:  # the big graph still has too many nodes
            with pytest.raises(RuntimeError, match="number of nodes"):
                list(loader)
            continue
        trimmed = list(loader)
        assert sum(int(b.graphs_mask.sum()) for b in trimmed) == len(data)
        for batch in trimmed:
            assert batch.x.shape == (45, 5) and batch.edge_index.shape == (2, 150)
            check_edge_index_inside(batch)


@pytest.mark.parametrize("device_iterations", [1, 3])
@pytest.mark.parametrize("strategy", [pg.FixedSizeStrategy.PadToMax,
                                      pg.FixedSizeStrategy.StreamPack])
def test_poptorch_loader_joins_the_micro_batches_of_a_call(device_iterations, strategy):
    data = dataset(40)
    options = pg.FixedSizeOptions(num_nodes=50, num_edges=150, num_graphs=5)
    opts = poptorch.Options().deviceIterations(device_iterations)
    loader = pg.FixedSizeDataLoader(data, batch_size=5, fixed_size_options=options,
                                    fixed_size_strategy=strategy, options=opts)
    plain = list(pyg_dataloader.FixedSizeDataLoader(data, batch_size=5,
                                                    fixed_size_options=options,
                                                    fixed_size_strategy=strategy))
    combined = list(loader)
    assert len(combined) == len(plain) // device_iterations
    for index, batch in enumerate(combined):
        parts = plain[index * device_iterations:(index + 1) * device_iterations]
        for key in ("x", "edge_index", "edge_attr", "y", "batch", "ptr", "nodes_mask",
                    "edges_mask", "graphs_mask"):
            torch.testing.assert_close(batch[key], torch.cat([p[key] for p in parts]))
        assert batch.num_nodes == 50 and batch.num_graphs == 5
        for part in torch.split(batch.edge_index, 2):
            assert int(part.max()) < 50


def test_poptorch_heterogeneous_loader_and_data_loader():
    data = hetero_dataset()
    options = pg.FixedSizeOptions(num_nodes={"u": 20, "v": 20},
                                  num_edges={("u", "e", "v"): 30, ("v", "e", "u"): 30},
                                  num_graphs=4)
    opts = poptorch.Options().deviceIterations(2)
    for strategy in pg.FixedSizeStrategy:
        loader = pg.FixedSizeDataLoader(data, batch_size=4, fixed_size_options=options,
                                        fixed_size_strategy=strategy, options=opts)
        plain = list(pyg_dataloader.FixedSizeDataLoader(
            data, batch_size=4, fixed_size_options=options, fixed_size_strategy=strategy))
        for index, batch in enumerate(loader):
            parts = plain[2 * index:2 * index + 2]
            assert batch.num_nodes == 40 and batch.num_edges == 60
            for node_type in ("u", "v"):
                torch.testing.assert_close(batch[node_type].x,
                                           torch.cat([p[node_type].x for p in parts]))
                assert batch[node_type].num_nodes == 20
            for part in parts:
                check_edge_index_inside(part)
    # the plain DataLoader: micro-batches of batch_size graphs, joined; their shapes
    # must agree (here: every graph padded to 12 nodes and 40 edges)
    padded = [pyg.transforms.Pad(12, 40)(d) for d in dataset(12)]
    loader = pg.DataLoader(padded, batch_size=3, options=opts)
    reference = list(PyGLoader(padded, batch_size=3))
    for index, batch in enumerate(loader):
        first, second = reference[2 * index:2 * index + 2]
        for key in ("x", "edge_index", "edge_attr", "batch"):
            torch.testing.assert_close(batch[key], torch.cat([first[key], second[key]]))
        assert batch.num_nodes == first.num_nodes and batch.num_graphs == 3
    with pytest.raises(poptorch.Error, match="different shapes for 'batch'"):
        next(iter(pg.DataLoader(dataset(12), batch_size=3, options=opts)))


def test_stream_packing_sampler_packs_greedily_within_limits():
    data = dataset(50)
    sampler = pg.StreamPackingSampler(data, max_num_graphs=6, max_num_nodes=40,
                                      max_num_edges=90)
    batches = list(sampler)
    assert [i for b in batches for i in b] == list(range(50))
    for position, indices in enumerate(batches):
        nodes = sum(data[i].num_nodes for i in indices)
        edges = sum(data[i].num_edges for i in indices)
        left = 6 - len(indices)
        assert len(indices) <= 6 and nodes + left <= 40 and edges + left <= 90
        if position + 1 < len(batches):  # the next graph did not fit
            nxt = data[batches[position + 1][0]]
            left -= 1
            assert (left < 0 or nodes + nxt.num_nodes + left > 40
                    or edges + nxt.num_edges + left > 90)
    assert len(sampler) == len(batches)
    shuffled = pg.StreamPackingSampler(data, 6, 40, 90,
                                       base_sampler=torch.utils.data.RandomSampler(data))
    with pytest.raises(TypeError, match="no length"):
        len(shuffled)
    assert sorted(i for b in shuffled for i in b) == list(range(50))
    with pytest.raises(RuntimeError, match="too small to fit in the single sample"):
        list(pg.StreamPackingSampler(data, 2, max_num_nodes=3))
    assert list(pg.StreamPackingSampler(data, 2, max_num_nodes=2,
                                        allow_skip_data=True)) == []
    with pytest.raises(ValueError, match="max_num_nodes"):
        pg.StreamPackingSampler(data, 4, max_num_nodes=3)


def test_fixed_size_options_from_dataset_and_loader():
    data = dataset()
    options = pg.FixedSizeOptions.from_dataset(data, 6)
    assert options.num_nodes == max(d.num_nodes for d in data) * 5 + 1
    assert options.num_edges == max(d.num_edges for d in data) * 5 + 1
    assert options.num_graphs == 6
    limited = pg.FixedSizeOptions.from_dataset(data, 6, sample_limit=5)
    assert limited.num_nodes == max(d.num_nodes for d in data[:5]) * 5 + 1
    loader = PyGLoader(data, batch_size=7)
    from_loader = pg.FixedSizeOptions.from_loader(loader)
    batches = list(loader)
    assert from_loader.num_nodes == max(b.num_nodes for b in batches) + 1
    assert from_loader.num_edges == max(b.num_edges for b in batches) + 1
    assert from_loader.num_graphs == 8
    hetero = hetero_dataset()
    per_type = pg.FixedSizeOptions.from_dataset(hetero, 3)
    assert per_type.num_nodes == {t: max(d[t].num_nodes for d in hetero) * 2 + 1
                                  for t in ("u", "v")}
    assert per_type.is_hetero() and per_type.total_num_nodes == sum(
        per_type.num_nodes.values())
    with pytest.raises(ValueError, match="at least 2"):
        pg.FixedSizeOptions(num_nodes=5, num_graphs=1)
    assert pg.FixedSizeOptions(num_nodes=5).num_edges == 20
