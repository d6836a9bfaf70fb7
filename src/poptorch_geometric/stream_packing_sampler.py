"""``StreamPackingSampler``: batches of as many graphs as fit in fixed numbers of nodes,
edges and graphs, packed in the order a base sampler gives them."""
from __future__ import annotations

from collections.abc import Iterable, Iterator, Sized
from dataclasses import dataclass, field
from typing import Any

from torch.utils.data.sampler import RandomSampler, Sampler, SequentialSampler

__all__ = ["StreamPackingSampler"]


@dataclass
class _Pack:
    """The indices of one batch and their numbers of nodes, edges and graphs."""

    indices: list[int] = field(default_factory=list)
    num_nodes: int = 0
    num_edges: int = 0

    @property
    def num_graphs(self) -> int:
        return len(self.indices)

    def add(self, index: int, num_nodes: int, num_edges: int) -> None:
        self.indices.append(index)
        self.num_nodes += num_nodes
        self.num_edges += num_edges


class StreamPackingSampler(Sampler[list[int]]):
    """Yields batches of indices of ``data_source``: graphs are taken one at a time in
    the order of ``base_sampler`` and added to the current batch while it stays within
    ``max_num_graphs``, ``max_num_nodes`` and ``max_num_edges``, keeping one node and one
    edge for each graph the batch could still take (so that the batch can be padded with
    one padding graph per missing graph); otherwise the batch is yielded and a new one
    starts. No preprocessing of the data set is needed.

    Args:
        data_source: The data set (``Data`` or ``HeteroData`` items; the numbers of
            nodes and edges of a heterogeneous graph are summed over its types).
        max_num_graphs: The largest number of graphs in a batch (at least 1).
        max_num_nodes: The largest number of nodes in a batch. Default:
            ``max_num_graphs`` times the largest graph's number of nodes.
        max_num_edges: The largest number of edges in a batch. Default:
            ``max_num_graphs`` times the largest graph's number of edges.
        base_sampler: The order in which graphs are taken (any iterable of indices).
            Default: ``SequentialSampler(data_source)``.
        allow_skip_data: When True, a graph that does not fit even in an empty batch
            is skipped; otherwise a :py:exc:`RuntimeError` says which graph and why.
    """

    def __init__(self, data_source: Any, max_num_graphs: int,
                 max_num_nodes: int | None = None, max_num_edges: int | None = None,
                 base_sampler: Sampler[int] | Iterable[int] | None = None,
                 allow_skip_data: bool | None = False) -> None:
        super().__init__()
        _validate(base_sampler, max_num_graphs, max_num_nodes, max_num_edges)
        self.data_source = data_source
        self.max_num_graphs = max_num_graphs
        if max_num_nodes is None:
            max_num_nodes = max(data.num_nodes for data in data_source) * max_num_graphs
        if max_num_edges is None:
            max_num_edges = max(data.num_edges for data in data_source) * max_num_graphs
        self.max_num_nodes: int = max_num_nodes
        self.max_num_edges: int = max_num_edges
        self.base_sampler = (SequentialSampler(data_source) if base_sampler is None
                             else base_sampler)
        self.allow_skip_data = bool(allow_skip_data)
        self._length: int | None = None

    def __iter__(self) -> Iterator[list[int]]:
        pack = _Pack()
        for index in self.base_sampler:
            data = self.data_source[index]
            nodes, edges = data.num_nodes, data.num_edges
            if not self._fits(pack, nodes, edges) and pack.num_graphs:
                yield pack.indices
                pack = _Pack()
            if self._fits(pack, nodes, edges):
                pack.add(index, nodes, edges)
            elif not self.allow_skip_data:
                raise RuntimeError(
                    f"The maximum number of graphs, nodes or edges specified is too small "
                    f"to fit in the single sample {index} with {nodes} nodes and {edges} "
                    f"edges. The maximum number of graphs specified is "
                    f"{self.max_num_graphs}, the maximum number of nodes is "
                    f"{self.max_num_nodes} and the maximum number of edges is "
                    f"{self.max_num_edges}. If this is intended, use `allow_skip_data` to "
                    f"enable this sample to be completely skipped from batching. The "
                    f"sample is {data}.")
        if pack.num_graphs:
            yield pack.indices

    def _fits(self, pack: _Pack, nodes: int, edges: int) -> bool:
        """Whether a graph of ``nodes`` nodes and ``edges`` edges fits in ``pack``, with
        a node and an edge left for each graph the batch could still take."""
        graphs_left = self.max_num_graphs - (pack.num_graphs + 1)
        nodes_left = self.max_num_nodes - (pack.num_nodes + nodes)
        edges_left = self.max_num_edges - (pack.num_edges + edges)
        return graphs_left >= 0 and nodes_left >= graphs_left and edges_left >= graphs_left

    def __len__(self) -> int:
        """The number of batches of a pass; a ``TypeError`` (no length) when the base
        sampler shuffles, as the number of batches then changes from pass to pass."""
        if isinstance(self.base_sampler, RandomSampler):
            raise TypeError(
                f"{self.__class__.__name__} has no length with a RandomSampler as its "
                "base sampler: each pass packs a different order into a different number "
                "of batches. Iterate it without asking for its length.")
        if self._length is None:
            self._length = sum(1 for _ in self)
        return self._length


def _validate(base_sampler: Any, max_num_graphs: Any, max_num_nodes: Any,
              max_num_edges: Any) -> None:
    if isinstance(base_sampler, Sized) and len(base_sampler) == 0:
        raise ValueError(f"The `sampler` {base_sampler} provided is invalid, the length "
                         "of the sampler must be greater than 0.")
    if max_num_graphs is None:
        raise ValueError("Invalid value for `max_num_graphs` parameter. `max_num_graphs` "
                         "must be an integer of at least 1, it is None.")
    for name, value, least in (("max_num_graphs", max_num_graphs, 1),
                               ("max_num_nodes", max_num_nodes, max_num_graphs),
                               ("max_num_edges", max_num_edges, max_num_graphs)):
        if value is not None and value < least:
            raise ValueError(f"Invalid value for `{name}` parameter, {name} should be at "
                             f"least {least} (one per graph of a full batch), got {value}.")
