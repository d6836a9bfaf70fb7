"""``FixedSizeOptions``: the numbers of nodes, edges and graphs every batch is padded to."""
from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from torch_geometric.data import HeteroData
from torch_geometric.typing import EdgeType, NodeType

__all__ = ["FixedSizeOptions", "validate_num_graphs"]

Count = int | dict[Any, int]


def validate_num_graphs(num_graphs: int) -> None:
    """A fixed-size batch holds at least one real graph and one padding graph."""
    if isinstance(num_graphs, bool) or not isinstance(num_graphs, int) or num_graphs < 2:
        raise ValueError("The number of graphs in the batch must be at least 2, got "
                         f"{num_graphs!r}: a fixed-size batch holds at least one real graph "
                         "and one graph reserved for padding the batch to its fixed size.")


class FixedSizeOptions:
    """How a batch is padded to a fixed size: its numbers of nodes, edges and graphs
    (real and padding ones together) and the values padding fills in.

    Args:
        num_nodes: The number of nodes of a padded batch; for heterogeneous graphs
            also a dictionary with a number per node type.
        num_edges: The number of edges of a padded batch (a dictionary per edge type
            for heterogeneous graphs). Default: ``num_nodes * (num_nodes - 1)`` (a fully
            connected graph; for a dictionary of node counts, their sum).
        num_graphs: The number of graphs of a padded batch, at least 2: one real graph
            and one padding graph.
        node_pad_value: The value of the padding nodes' features (default 0.0).
        edge_pad_value: The value of the padding edges' features (default 0.0).
        graph_pad_value: The value of the padding graphs' features (default 0.0).
        pad_graph_defaults: Values of the non-tensor attributes (names, ...) of the
            padding graphs, by attribute name; an attribute not named here takes the
            value of the first graph of the batch.
    """

    def __init__(self, num_nodes: Count, num_edges: Count | None = None,
                 num_graphs: int = 2, node_pad_value: float | None = None,
                 edge_pad_value: float | None = None,
                 graph_pad_value: float | None = None,
                 pad_graph_defaults: dict[str, Any] | None = None) -> None:
        _check_count("num_nodes", num_nodes)
        self.num_nodes: Count = num_nodes
        if num_edges:
            _check_count("num_edges", num_edges)
            self.num_edges: Count = num_edges
        else:  # a fully connected graph of all the nodes
            total = sum(num_nodes.values()) if isinstance(num_nodes, dict) else num_nodes
            self.num_edges = total * (total - 1)
        validate_num_graphs(num_graphs)
        self.num_graphs = num_graphs
        self.node_pad_value = 0.0 if node_pad_value is None else node_pad_value
        self.edge_pad_value = 0.0 if edge_pad_value is None else edge_pad_value
        self.graph_pad_value = 0.0 if graph_pad_value is None else graph_pad_value
        self.pad_graph_defaults = dict(pad_graph_defaults or {})

    def is_hetero(self) -> bool:
        """Whether the numbers of nodes and edges are given per node and edge type."""
        return isinstance(self.num_nodes, dict) and isinstance(self.num_edges, dict)

    def to_hetero(self, node_types: Sequence[NodeType],
                  edge_types: Sequence[EdgeType]) -> FixedSizeOptions:
        """Gives a single number of nodes (edges) to every node (edge) type; in place,
        returns ``self``."""
        if not isinstance(self.num_nodes, dict):
            self.num_nodes = dict.fromkeys(node_types, self.num_nodes)
        if not isinstance(self.num_edges, dict):
            self.num_edges = dict.fromkeys(edge_types, self.num_edges)
        return self

    @property
    def total_num_nodes(self) -> int:
        """The number of nodes of a padded batch, all node types together."""
        nodes = self.num_nodes
        return sum(nodes.values()) if isinstance(nodes, dict) else nodes

    @property
    def total_num_edges(self) -> int:
        """The number of edges of a padded batch, all edge types together."""
        edges = self.num_edges
        return sum(edges.values()) if isinstance(edges, dict) else edges

    @classmethod
    def from_dataset(cls, dataset: Sequence[Any], batch_size: int,
                     sample_limit: int | None = None,
                     progress_bar: bool | None = None) -> FixedSizeOptions:
        """Options that fit any ``batch_size - 1`` graphs of ``dataset`` plus a padding
        graph: ``batch_size - 1`` times the largest graph's nodes (edges), plus one.

        ``sample_limit`` reads only that many graphs from the start of the data set
        (then the sizes are an estimate); ``progress_bar`` shows the reading.
        """
        validate_num_graphs(batch_size)
        count = len(dataset) if sample_limit is None else min(sample_limit, len(dataset))
        graphs: Iterable[Any] = (dataset[i] for i in range(count))
        if progress_bar:
            from tqdm import tqdm
            graphs = tqdm(graphs, total=count, desc="FixedSizeOptions.from_dataset")
        max_nodes, max_edges, _ = _largest(graphs)

        def scaled(largest: int) -> int:
            return largest * (batch_size - 1) + 1

        return cls(num_nodes=_map_counts(max_nodes, scaled),
                   num_edges=_map_counts(max_edges, scaled), num_graphs=batch_size)

    @classmethod
    def from_loader(cls, loader: Iterable[Any], sample_limit: int = 1000) -> FixedSizeOptions:
        """Options that fit the batches of ``loader`` plus room for padding: the largest
        numbers of nodes, edges and graphs seen in ``sample_limit`` batches (the loader
        is iterated again when it has fewer), each plus one.

        A loader does not produce every combination of graphs, so the result is an
        estimate of the largest batch it can produce.
        """
        if sample_limit < 1:
            raise ValueError(f"sample_limit must be at least 1, got {sample_limit}.")
        max_nodes, max_edges, max_graphs = _largest(_repeat(loader, sample_limit))

        def plus_one(largest: int) -> int:
            return largest + 1

        return cls(num_nodes=_map_counts(max_nodes, plus_one),
                   num_edges=_map_counts(max_edges, plus_one), num_graphs=max_graphs + 1)

    def __repr__(self) -> str:
        return (f"{self.__class__.__name__}("
                f"num_nodes={self.num_nodes} (At least one node reserved for padding), "
                f"num_edges={self.num_edges} (At least one edge reserved for padding), "
                f"num_graphs={self.num_graphs} (At least one graph reserved for padding), "
                f"node_pad_value={self.node_pad_value}, "
                f"edge_pad_value={self.edge_pad_value}, "
                f"graph_pad_value={self.graph_pad_value}, "
                f"pad_graph_defaults={self.pad_graph_defaults})")


def _check_count(name: str, value: Any) -> None:
    values = value.values() if isinstance(value, dict) else [value]
    for number in values:
        if isinstance(number, bool) or not isinstance(number, int) or number < 0:
            raise ValueError(f"FixedSizeOptions: {name} must be a non-negative int (or a "
                             f"dictionary of them per type), got {value!r}.")


def _repeat(loader: Iterable[Any], limit: int) -> Iterator[Any]:
    """``limit`` batches of ``loader``, iterating it again as often as needed."""
    count = 0
    while True:
        produced = False
        for batch in loader:
            produced = True
            yield batch
            count += 1
            if count >= limit:
                return
        if not produced:
            raise ValueError("FixedSizeOptions.from_loader: the loader produced no batch.")


def _largest(graphs: Iterable[Any]) -> tuple[Count, Count, int]:
    """The largest numbers of nodes and edges (per type for heterogeneous graphs) and of
    graphs (1 for a graph that is not a batch) among ``graphs``."""
    nodes: dict[Any, int] = {}
    edges: dict[Any, int] = {}
    hetero = None
    most_graphs = 0
    seen = False
    for data in graphs:
        seen = True
        hetero = isinstance(data, HeteroData)
        node_counts: list[tuple[Any, int]]
        edge_counts: list[tuple[Any, int]]
        if hetero:
            node_counts = [(t, data[t].num_nodes or 0) for t in data.node_types]
            edge_counts = [(t, data[t].num_edges) for t in data.edge_types]
        else:
            node_counts = [(None, data.num_nodes or 0)]
            edge_counts = [(None, data.num_edges)]
        for key, number in node_counts:
            nodes[key] = max(nodes.get(key, 0), number)
        for key, number in edge_counts:
            edges[key] = max(edges.get(key, 0), number)
        most_graphs = max(most_graphs, getattr(data, "num_graphs", None) or 1)
    if not seen:
        raise ValueError("FixedSizeOptions: no graph to measure (the data set is empty).")
    if hetero:
        return nodes, edges, most_graphs
    return nodes.get(None, 0), edges.get(None, 0), most_graphs


def _map_counts(counts: Count, scale: Any) -> Count:
    if isinstance(counts, dict):
        return {key: scale(value) for key, value in counts.items()}
    return scale(counts)
