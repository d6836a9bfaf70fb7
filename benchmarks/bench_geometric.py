"""PopTorch Geometric against the PyG loops a user would write, side by side.

Generated graph-classification data (graphs of 10 to 40 nodes, 2 to 4 edges per node
plus self-loops, 32 features, 4 classes), a GCN and a GIN (3 layers of 64), trained with
Adam on batches of ``--batch`` graphs through:

* ``eager``: the plain PyG loop over PyG's ``DataLoader`` batches (zero_grad, forward,
  backward, step);
* ``compile``: the same loop over ``torch.compile(model, dynamic=True)``;
* ``pop``: ``poptorch.trainingModel`` with default options (no backend chosen: the
  automatic backend) over ``poptorch_geometric.FixedSizeDataLoader`` batches: the same
  graphs per step plus one padding graph, padded to fixed sizes measured on the data
  (``FixedSizeOptions.from_loader``), the loss masking the padding graph.

Batches are collated before timing (the loaders are measured apart). Throughput is real
graphs per second, the median of interleaved rounds (one pass over the data per
contender per round, in alternating order); the ratios are medians of per-round ratios,
so that load drifting on a shared machine cancels. The first pass of each contender
(compiling, and for ``pop`` the automatic backend's trial) is timed apart, and torch's
compile counters (``unique_graphs``) are read around it and around the timed rounds
(recompiles: graphs compiled after the first pass).

The loaders: graphs per second of a full pass of ``FixedSizeDataLoader`` (the
``poptorch.DataLoader`` version, default options, and the plain torch version) against
PyG's ``DataLoader`` on the same data and the same real graphs per batch.

Targets (issues 33, 39): ``pop`` >= max(eager, compile) in graphs/s; the fixed-size
loader >= 0.95 x PyG's DataLoader.

Run: ``python benchmarks/bench_geometric.py [--quick] [--model gcn|gin] [--threads N]``
(one torch thread by default). About 4 minutes on a 2-core machine (``--quick``: about
2), most of it compiling.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

os.environ.setdefault("POPTORCH_LOG_LEVEL", "WARN")
import itertools

from torch_geometric.data import Data
from torch_geometric.loader import DataLoader as PyGDataLoader
from torch_geometric.nn import GCNConv, GINConv, global_add_pool, global_mean_pool

import poptorch
import poptorch_geometric as pg
from poptorch._runtime.torch_internals import dynamo_counters
from poptorch_geometric import pyg_dataloader

FEATURES, HIDDEN, CLASSES = 32, 64, 4


def make_dataset(count: int, seed: int = 0) -> list[Data]:
    """Graphs of 10-40 nodes, 2-4 edges per node plus a self-loop on every node."""
    gen = torch.Generator().manual_seed(seed)
    graphs = []
    for _ in range(count):
        n = int(torch.randint(10, 41, (), generator=gen))
        e = n * int(torch.randint(2, 5, (), generator=gen))
        edges = torch.randint(n, (2, e), generator=gen)
        loops = torch.arange(n).repeat(2, 1)
        graphs.append(Data(x=torch.randn(n, FEATURES, generator=gen),
                           edge_index=torch.cat([edges, loops], dim=1),
                           y=torch.randint(CLASSES, (1,), generator=gen)))
    return graphs


class GraphClassifier(torch.nn.Module):
    """Three message-passing layers, pooling into ``len(y)`` graphs, a linear head; the
    loss is the mean over the graphs, weighted by ``graph_weight`` when given (0 for a
    padding graph). GCN layers take the self-loops from the data (GCNConv's own would
    add a data-dependent number of edges)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        sizes = [FEATURES, HIDDEN, HIDDEN, HIDDEN]
        if kind == "gcn":
            self.convs = torch.nn.ModuleList(
                GCNConv(a, b, add_self_loops=False) for a, b in itertools.pairwise(sizes))
        else:
            self.convs = torch.nn.ModuleList(
                GINConv(torch.nn.Sequential(torch.nn.Linear(a, b), torch.nn.ReLU(),
                                            torch.nn.Linear(b, b)))
                for a, b in itertools.pairwise(sizes))
        self.head = torch.nn.Linear(HIDDEN, CLASSES)

    def forward(self, x: torch.Tensor, edge_index: torch.Tensor, batch: torch.Tensor,
                y: torch.Tensor, graph_weight: torch.Tensor | None = None) -> Any:
        for conv in self.convs:
            x = conv(x, edge_index).relu()
        pool = global_mean_pool if self.kind == "gcn" else global_add_pool
        out = self.head(pool(x, batch, size=y.shape[0]))
        if graph_weight is None:
            return out, F.cross_entropy(out, y)
        losses = F.cross_entropy(out, y, reduction="none") * graph_weight
        return out, losses.sum() / graph_weight.sum()


# --------------------------------------------------------------------------- contenders

class Contender:
    """One way of training; ``run_pass()`` trains one pass over its batches."""

    def __init__(self, name: str, batches: list[Any], step: Callable[[Any], Any],
                 graphs: int) -> None:
        self.name, self.batches, self.step, self.graphs = name, batches, step, graphs
        self.first_pass = 0.0
        self.compiled_first = self.compiled_later = 0

    def run_pass(self) -> float:
        start = time.perf_counter()
        for batch in self.batches:
            self.step(batch)
        return time.perf_counter() - start


def unique_graphs() -> int:
    return int(dynamo_counters()["stats"]["unique_graphs"])


def plain_loop(model: torch.nn.Module) -> Callable[[Any], Any]:
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)

    def step(batch: Any) -> None:
        optimizer.zero_grad()
        _, loss = model(batch.x, batch.edge_index, batch.batch, batch.y)
        loss.backward()
        optimizer.step()
    return step


def poptorch_loop(model: torch.nn.Module) -> Callable[[Any], Any]:
    training = poptorch.trainingModel(model, options=poptorch.Options(),
                                      optimizer=torch.optim.Adam(model.parameters(), lr=1e-3))

    def step(batch: Any) -> None:
        training(batch.x, batch.edge_index, batch.batch, batch.y, batch.weight)
    return step


def fixed_size_batches(data: list[Data], batch: int) -> tuple[list[Any], float]:
    """The PadToMax batches of ``batch`` real graphs plus a padding graph, sized by
    ``FixedSizeOptions.from_loader`` on PyG's batches; and the share of padding nodes."""
    sizes = pg.FixedSizeOptions.from_loader(PyGDataLoader(data, batch_size=batch),
                                            sample_limit=len(data) // batch + 1)
    loader = pg.FixedSizeDataLoader(data, batch_size=batch + 1, fixed_size_options=sizes)
    batches = []
    real = 0
    for padded in loader:
        padded.weight = padded.graphs_mask.float()
        batches.append(padded)
        real += int(padded.nodes_mask.sum())
    return batches, 1 - real / (len(batches) * sizes.num_nodes)


def measure_training(kind: str, data: list[Data], batch: int, rounds: int) -> None:
    pyg_batches = list(PyGDataLoader(data, batch_size=batch))
    pyg_batches = pyg_batches[:len(data) // batch]  # whole batches, as the padded loader
    padded, padding = fixed_size_batches(data, batch)
    graphs = len(pyg_batches) * batch
    torch.manual_seed(0)
    base = GraphClassifier(kind)
    contenders = [
        Contender("eager", pyg_batches, plain_loop(_copy(base)), graphs),
        Contender("compile", pyg_batches,
                  plain_loop(torch.compile(_copy(base), dynamic=True)), graphs),
        Contender("pop", padded, poptorch_loop(_copy(base)), graphs),
    ]
    for contender in contenders:
        before = unique_graphs()
        contender.first_pass = contender.run_pass()
        contender.compiled_first = unique_graphs() - before
    times: dict[str, list[float]] = {c.name: [] for c in contenders}
    for index in range(rounds):
        order = contenders if index % 2 == 0 else contenders[::-1]
        for contender in order:
            before = unique_graphs()
            times[contender.name].append(contender.run_pass())
            contender.compiled_later += unique_graphs() - before
    print(f"\n{kind.upper()}: {graphs} graphs per pass in batches of {batch} "
          f"(pop: {batch} + 1 padding graph, {padding:.0%} of its nodes are padding)")
    print(f"{'contender':<10} {'graphs/s':>10} {'first pass s':>13} {'compiled':>9} "
          f"{'recompiled':>11}")
    for contender in contenders:
        rate = graphs / statistics.median(times[contender.name])
        print(f"{contender.name:<10} {rate:>10.0f} {contender.first_pass:>13.2f} "
              f"{contender.compiled_first:>9} {contender.compiled_later:>11}")
    ratio = {other: statistics.median(o / p for o, p in zip(times[other], times["pop"],
                                                             strict=True))
             for other in ("eager", "compile")}
    best = min(ratio.values())
    print(f"pop / eager {ratio['eager']:.2f}x, pop / compile {ratio['compile']:.2f}x; "
          f"target pop >= max(eager, compile): {'PASS' if best >= 1 else 'MISS'} "
          f"({best:.2f}x of the faster)")


def _copy(model: torch.nn.Module) -> torch.nn.Module:
    copied = GraphClassifier(model.kind)
    copied.load_state_dict(model.state_dict())
    return copied


def measure_loaders(data: list[Data], batch: int, rounds: int) -> None:
    sizes = pg.FixedSizeOptions.from_loader(PyGDataLoader(data, batch_size=batch),
                                            sample_limit=len(data) // batch + 1)
    loaders: dict[str, Callable[[], Any]] = {
        "pyg DataLoader": lambda: PyGDataLoader(data, batch_size=batch),
        "FixedSizeDataLoader": lambda: pg.FixedSizeDataLoader(
            data, batch_size=batch + 1, fixed_size_options=sizes),
        "pyg_dataloader.Fixed...": lambda: pyg_dataloader.FixedSizeDataLoader(
            data, batch_size=batch + 1, fixed_size_options=sizes),
    }
    times: dict[str, list[float]] = {name: [] for name in loaders}
    for index in range(rounds):
        names = list(loaders) if index % 2 == 0 else list(loaders)[::-1]
        for name in names:
            loader = loaders[name]()
            start = time.perf_counter()
            for _ in loader:
                pass
            times[name].append(time.perf_counter() - start)
    print(f"\nLoaders: a pass over {len(data)} graphs, {batch} real graphs per batch")
    reference = times["pyg DataLoader"]
    for name, runs in times.items():
        ratio = statistics.median(r / t for r, t in zip(reference, runs, strict=True))
        print(f"{name:<24} {len(data) / statistics.median(runs):>10.0f} graphs/s "
              f"{ratio:>6.2f}x PyG")
    ratio = statistics.median(r / t for r, t in zip(reference, times["FixedSizeDataLoader"],
                                                    strict=True))
    print(f"target FixedSizeDataLoader >= 0.95x PyG's DataLoader: "
          f"{'PASS' if ratio >= 0.95 else 'MISS'} ({ratio:.2f}x)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer graphs and rounds")
    parser.add_argument("--model", choices=("gcn", "gin"), action="append",
                        help="only this model (repeatable)")
    parser.add_argument("--batch", type=int, default=32, help="real graphs per batch")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (default 1: on a shared machine two threads "
                             "spinning against other jobs make every contender 10x slower)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    count, rounds = (640, 3) if args.quick else (1920, 5)
    data = make_dataset(count)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"{count} graphs, {rounds} timed rounds")
    for kind in args.model or ["gcn", "gin"]:
        measure_training(kind, data, args.batch, rounds)
    measure_loaders(data, args.batch, rounds)


if __name__ == "__main__":
    main()
