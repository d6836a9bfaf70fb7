"""Training graph networks through PopTorch on fixed-size batches, against the plain
PyG loop on the same padded batches; the compiled backend compiles once for the
epoch; PyG graphs as model arguments; TrainingStepper and set_aggregation_dim_size."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

pyg = pytest.importorskip("torch_geometric")
from torch_geometric.data import Batch, Data, HeteroData  # noqa: E402
from torch_geometric.nn import GCNConv, SimpleConv, global_mean_pool  # noqa: E402

import poptorch  # noqa: E402
import poptorch_geometric as pg  # noqa: E402
from poptorch._runtime.torch_internals import dynamo_counters, pytree  # noqa: E402
from poptorch_geometric import pyg_dataloader  # noqa: E402

NUM_GRAPHS = 6  # per padded batch: 5 real graphs and a padding graph


def dataset(count: int = 40, seed: int = 0) -> list[Data]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        n = int(torch.randint(3, 12, (), generator=gen))
        e = int(torch.randint(n, 3 * n, (), generator=gen))
        out.append(Data(x=torch.randn(n, 8, generator=gen),
                        edge_index=torch.randint(n, (2, e), generator=gen),
                        y=torch.randint(3, (1,), generator=gen)))
    return out


class GCN(torch.nn.Module):
    """A graph classifier of fixed shapes: self-loops come with the data (GCNConv's own
    would add a data-dependent number of edges), pooling into a fixed number of graphs
    and a loss that masks the padding graphs."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = GCNConv(8, 16, add_self_loops=False)
        self.conv2 = GCNConv(16, 16, add_self_loops=False)
        self.head = torch.nn.Linear(16, 3)

    def forward(self, x, edge_index, batch, graphs_mask, y):
        h = self.conv1(x, edge_index).relu()
        h = self.conv2(h, edge_index).relu()
        out = self.head(global_mean_pool(h, batch, size=graphs_mask.shape[0]))
        mask = graphs_mask.to(out.dtype)
        loss = (F.cross_entropy(out, y, reduction="none") * mask).sum() / mask.sum()
        return out, loss


class GCNOnBatch(GCN):
    def forward(self, data):
        return super().forward(data.x, data.edge_index, data.batch, data.graphs_mask, data.y)


def loaders(device_iterations: int):
    data = dataset()
    options = pg.FixedSizeOptions(num_nodes=60, num_edges=200, num_graphs=NUM_GRAPHS)
    opts = poptorch.Options().deviceIterations(device_iterations)
    loader = pg.FixedSizeDataLoader(data, batch_size=NUM_GRAPHS, fixed_size_options=options,
                                    options=opts)
    plain = pyg_dataloader.FixedSizeDataLoader(data, batch_size=NUM_GRAPHS,
                                               fixed_size_options=options)
    return opts, loader, plain


def reference_epoch(model: torch.nn.Module, plain, lr: float) -> list[torch.Tensor]:
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for batch in plain:
        optimizer.zero_grad()
        _, loss = GCN.forward(model, batch.x, batch.edge_index, batch.batch,
                              batch.graphs_mask, batch.y)
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    return losses


@pytest.mark.parametrize("device_iterations,model_class", [(2, GCN), (1, GCNOnBatch)])
def test_training_through_the_fixed_size_loader_matches_the_pyg_loop(device_iterations,
                                                                     model_class):
    torch.manual_seed(0)
    model = model_class()
    reference = copy.deepcopy(model)
    opts, loader, plain = loaders(device_iterations)
    training = poptorch.trainingModel(model, options=opts,
                                      optimizer=poptorch.optim.SGD(model.parameters(),
                                                                   lr=0.1))
    losses = []
    for batch in loader:
        if model_class is GCN:
            _, loss = training(batch.x, batch.edge_index, batch.batch, batch.graphs_mask,
                               batch.y)
        else:
            _, loss = training(batch)  # the whole PyG batch: PyGArgsParser takes it apart
        losses.append(loss.reshape(-1))
    expected = reference_epoch(reference, list(plain), lr=0.1)
    training.copyWeightsToHost()
    for actual, wanted in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(actual, wanted)
    # the loss of the last micro-batch of each call
    torch.testing.assert_close(torch.stack([x[-1] for x in losses]),
                               torch.stack(expected[device_iterations - 1::device_iterations]))


@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
def test_the_compiled_backend_compiles_once_for_the_epoch(monkeypatch, compiler):
    """Fixed-size batches of graphs of different sizes: after the first calls no call
    compiles again (torch's own compile counters), and training matches eager.
    ``inductor``: the code generator's own kernels, with the settings of the fused
    micro-batch's graph (``compiled_step.FUSED_GRAPH_OPTIONS``)."""
    monkeypatch.setenv("POPTORCH_TORCH_COMPILE_BACKEND", compiler)
    torch.manual_seed(0)
    model = GCN()
    reference = copy.deepcopy(model)
    opts, loader, plain = loaders(1)
    opts = opts.clone()
    opts.Jit.backend("inductor")
    training = poptorch.trainingModel(model, options=opts,
                                      optimizer=poptorch.optim.SGD(model.parameters(),
                                                                   lr=0.1))
    counters = dynamo_counters()

    def compiles() -> tuple[int, int]:
        return (sum(counters["frames"].values()), counters["stats"]["unique_graphs"])

    before = compiles()
    batches = list(loader)
    assert len({int(b.nodes_mask.sum()) for b in batches}) > 1  # sizes do vary
    for batch in batches[:2]:
        training(batch.x, batch.edge_index, batch.batch, batch.graphs_mask, batch.y)
    after_first_calls = compiles()
    assert after_first_calls[1] > before[1], "the model was not compiled"
    for batch in batches[2:]:
        training(batch.x, batch.edge_index, batch.batch, batch.graphs_mask, batch.y)
    assert compiles() == after_first_calls, "a later batch compiled again"
    reference_epoch(reference, plain, lr=0.1)
    training.copyWeightsToHost()
    for actual, wanted in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(actual, wanted, rtol=1e-5, atol=1e-6)


def test_pyg_args_parser_takes_graphs_apart_and_rebuilds_them():
    parser = pg.PyGArgsParser()
    data = dataset(3)
    batch = Batch.from_data_list(data)
    hetero = HeteroData()
    hetero["a"].x = torch.randn(3, 2)
    hetero["a", "to", "a"].edge_index = torch.tensor([[0, 1], [1, 2]])
    hetero.name = "h"
    for struct in (data[0], batch, hetero):
        tensors = list(parser.yieldTensors(struct))
        rebuilt = parser.reconstruct(struct, iter([t * 2 for t in tensors]))
        assert type(rebuilt) is type(struct)
        for old, new in zip(tensors, parser.yieldTensors(rebuilt), strict=True):
            torch.testing.assert_close(new, old * 2)
        # the registered parser is what poptorch flattens a model argument with
        leaves, spec = pytree.tree_flatten(struct)
        assert len(leaves) == len(tensors) and all(a is b for a, b in zip(
            leaves, tensors, strict=True))
        assert type(pytree.tree_unflatten(leaves, spec)) is type(struct)
    assert batch.num_graphs == 3 and parser.reconstruct(batch, iter(
        parser.yieldTensors(batch))).num_graphs == 3
    with pytest.raises(ValueError, match="Unsupported data type"):
        list(parser.yieldTensors(torch.ones(2)))
    poptorch.registerGeometricCustomArgParsers()  # idempotent
    assert len(pytree.tree_leaves(batch)) == len(list(parser.yieldTensors(batch)))


def test_training_stepper_trains_both_copies_alike():
    torch.manual_seed(1)
    data = Batch.from_data_list(dataset(5))
    stepper = pg.TrainingStepper(GCN(), lr=0.01, optimizer=torch.optim.SGD,
                                 enable_fp_exception=False)
    before = [p.detach().clone() for p in stepper.cpu_model.parameters()]
    graphs_mask = torch.ones(5, dtype=torch.bool)
    stepper.run(3, (data.x, data.edge_index, data.batch, graphs_mask, data.y))
    assert any(not torch.equal(a, b) for a, b in zip(before, stepper.cpu_model.parameters(),
                                                     strict=True))
    with pytest.raises(AssertionError, match="loss was not equal"):
        stepper.assert_close(torch.ones(1), torch.zeros(1), "loss")
    with pytest.raises(ValueError, match="unknown devices"):
        stepper.benchmark(1, (), devices=("gpu",))


def test_set_aggregation_dim_size_fixes_the_output_rows():
    x = torch.randn(6, 3)
    edge_index = torch.tensor([[0, 1, 2, 5], [1, 2, 0, 3]])
    model = torch.nn.Sequential()
    model.add_module("conv", SimpleConv(aggr="sum"))
    pg.set_aggregation_dim_size(model, 10)
    out = model.conv(x, edge_index)
    expected = torch.zeros(10, 3).index_add_(0, edge_index[1], x[edge_index[0]])
    torch.testing.assert_close(out, expected)
    with pytest.raises(ValueError, match="positive int"):
        pg.set_aggregation_dim_size(model, 0)


def test_layer_maskers_with_no_masker_leave_layers_unchanged():
    layer = torch.nn.Linear(3, 2)
    x = torch.randn(4, 3)
    masker = pg.PreLayerMasker(pg.NoMasker())
    for wrap in (masker.node_masker, masker.edge_masker, masker.graph_masker):
        torch.testing.assert_close(wrap(layer)(x), layer(x))
    assert pg.NoMasker().node_masker(x) is x
