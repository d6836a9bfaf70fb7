"""Collaters: ``FixedSizeCollater`` pads a list of graphs into a batch of fixed size;
``CombinedBatchingCollater`` collates the micro-batches of one model call and joins them
into its combined batch."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch_geometric.data import Batch, HeteroData
from torch_geometric.data.data import BaseData

import poptorch
from poptorch._utils import combine_batch_tensors_gen

from .batching import padded_batch
from .fixed_size_options import FixedSizeOptions
from .levels import Infos, check_padded, classify
from .padding import padding_graph, split_evenly
from .pyg_collate import Collater
from .sizes import GraphSizes, measure
from .trimming import trim_edges, trim_nodes
from .types import PyGArgsParser

__all__ = ["CombinedBatchingCollater", "FixedSizeCollater", "make_exclude_keys"]

Counts = int | dict[Any, int]


def make_exclude_keys(include_keys: Sequence[str], data: BaseData) -> tuple[str, ...]:
    """The keys of ``data`` that are not in ``include_keys`` (for ``exclude_keys``)."""
    return tuple(set(data.keys()) - set(include_keys))


_OVERSIZE = ("The fixed sizes given don't allocate enough space for the number of "
             "{what} required to fit {real} sample(s) into a batch ({graphs} including "
             "extra padded graph(s)). Increase the maximum number of {what}, currently "
             "set to {limit}, or set `{trim}` to remove any excess {what} to achieve the "
             "given maximum number of {what}.")


class FixedSizeCollater(Collater):
    """Collates a list of graphs into a PyG ``Batch`` of fixed size: padding graphs
    complete it to ``num_graphs`` graphs, ``num_nodes`` nodes and ``num_edges`` edges
    (per type for ``HeteroData``; see :py:class:`FixedSizeOptions`).

    The padding nodes are divided evenly between the padding graphs, and the padding
    edges between the padding graphs that have nodes: every padding edge is a
    self-loop on a padding node, so that the batch's edge index stays within its
    nodes and never reaches a real node. A batch that does not fit raises a
    :py:exc:`RuntimeError`, unless trimming removes random nodes or edges first.

    Args:
        fixed_size_options: The sizes and padding values (a heterogeneous data list
            turns a single number of nodes or edges into one per type, in place).
        add_masks_to_batch: Add ``graphs_mask``, ``nodes_mask`` and ``edges_mask`` (per
            node and edge type for ``HeteroData``): True for real entries, False for
            padding.
        trim_nodes: Remove random nodes from a batch with too many (at least one node
            of each graph stays; one node per type is kept free for padding when the
            batch has padding graphs and room for it).
        trim_edges: Remove random edges from a batch with too many.
        follow_batch: Keys for which to add a batch assignment vector.
        exclude_keys: Keys to leave out of the batch.
        skip_over_size: Leave out of the batch the graphs that do not fit (taking them
            in order while they fit, with room for padding); the batch is padded as
            usual. Not with trimming.

    The batch stores its number of nodes (``num_nodes`` of the batch, of each node
    store when heterogeneous): joined with other micro-batches along dimension 0 it
    still says what each micro-batch holds.

    Graphs of PyG's ``Data`` class are batched in one pass with their padding from the
    sizes measured for padding (:func:`poptorch_geometric.batching.padded_batch`); other
    graphs (``HeteroData``, subclasses, sparse values) with ``Batch.from_data_list``
    and padding graphs. Both give the same batch.
    """

    def __init__(self, fixed_size_options: FixedSizeOptions,
                 add_masks_to_batch: bool | None = False, trim_nodes: bool | None = False,
                 trim_edges: bool | None = False,
                 follow_batch: Sequence[str] | None = None,
                 exclude_keys: Sequence[str] | None = None, *,
                 skip_over_size: bool = False) -> None:
        super().__init__(follow_batch, exclude_keys)
        if skip_over_size and (trim_nodes or trim_edges):
            raise ValueError("FixedSizeCollater: skip_over_size leaves out the graphs that "
                             "do not fit, trimming makes them fit: choose one.")
        self.skip_over_size = bool(skip_over_size)
        self._known: Infos = {}  # attribute levels the batches so far showed for sure
        self._last_infos: Infos = {}
        self._aranges: dict[Any, torch.Tensor] = {}
        if not isinstance(fixed_size_options, FixedSizeOptions):
            raise TypeError("FixedSizeCollater: fixed_size_options must be a "
                            "poptorch_geometric.FixedSizeOptions, got "
                            f"{type(fixed_size_options).__name__}.")
        self.opts = fixed_size_options
        self.add_masks_to_batch = bool(add_masks_to_batch)
        self.trim_nodes = bool(trim_nodes)
        self.trim_edges = bool(trim_edges)

    def __call__(self, data_list: list[BaseData]) -> Batch:
        if not isinstance(data_list, list):
            raise TypeError(f"Expected list, got {type(data_list).__name__}.")
        if not data_list:
            raise ValueError("FixedSizeCollater: the list of graphs to collate is empty.")
        if any(type(d) is not type(data_list[0]) for d in data_list):
            raise TypeError("FixedSizeCollater: the graphs of a batch must be of one class, "
                            f"got {sorted({type(d).__name__ for d in data_list})}.")
        if isinstance(data_list[0], HeteroData) and not self.opts.is_hetero():
            self.opts.to_hetero(data_list[0].node_types, data_list[0].edge_types)
        if self.opts.num_graphs < len(data_list):
            raise RuntimeError(
                "The maximum number of graphs requested doesn't allocate enough room for all "
                "the graphs in the batch plus at least one extra graph required for padding "
                "the batch to a fixed size. The number of graphs received for batching is "
                f"{len(data_list) + 1}, including at least one padding graph, but space for "
                f"only {self.opts.num_graphs} graphs has been requested.")
        batch = self._collate(data_list, self._known)
        if not check_padded(batch, self._last_infos, self.opts.num_nodes, self.opts.num_edges):
            # a level this collater had learnt does not hold for this batch
            self._known.clear()
            batch = self._collate(data_list, self._known)
        return batch

    def _collate(self, data_list: list[BaseData], known: Infos) -> Batch:
        num_pad_graphs = self.opts.num_graphs - len(data_list)
        sizes = measure(data_list)
        infos = classify(data_list, self.exclude_keys, sizes, known)
        trimmed = self._trimmed(data_list, num_pad_graphs > 0, infos)
        if trimmed is not data_list:
            data_list, sizes = trimmed, measure(trimmed)
        if self.skip_over_size:
            data_list = self._fitting(data_list)
            num_pad_graphs = self.opts.num_graphs - len(data_list)
            sizes = measure(data_list)
        num_real = len(data_list)
        real_nodes, real_edges = sizes.totals()
        pad_nodes = _remaining(self.opts.num_nodes, real_nodes, "nodes", data_list)
        pad_edges = _remaining(self.opts.num_edges, real_edges, "edges", data_list)
        self._check_fits(pad_nodes, pad_edges, num_real)
        if num_pad_graphs == 0 and (_positive(pad_nodes) or _positive(pad_edges)):
            raise RuntimeError(
                f"Requested to pad a batch to {self.opts.num_graphs} graphs but collater got "
                f"a list of {num_real} graphs and cannot create additional graphs to pad "
                "nodes and edges.")
        _check_padding_nodes(data_list[0], pad_nodes, pad_edges)
        batch = self._batched(data_list, sizes, num_pad_graphs, pad_nodes, pad_edges, infos)
        if batch is None:  # PyG batches the graphs and their padding graphs
            padded = data_list + self._padding_graphs(data_list, num_pad_graphs, pad_nodes,
                                                      pad_edges, infos)
            batch = super().__call__(padded)
        if self.add_masks_to_batch:
            self._add_masks(batch, num_real, real_nodes, real_edges)
        _store_num_nodes(batch, self.opts.num_nodes)
        self._last_infos = infos
        return batch

    def _batched(self, data_list: list[BaseData], sizes: GraphSizes, count: int,
                 pad_nodes: Counts, pad_edges: Counts, infos: Infos) -> Batch | None:
        """The batch of plain ``Data`` graphs and ``count`` padding graphs in one pass
        from the measured sizes (:func:`padded_batch`); None for other graphs."""
        if not isinstance(pad_nodes, int):
            return None
        nodes_per_graph = _split(pad_nodes, count) if count else []
        edges_per_graph = _split_edges(data_list[0], pad_edges, nodes_per_graph) \
            if count else []
        return padded_batch(data_list, sizes.nodes[None], nodes_per_graph, edges_per_graph,
                            infos, self.opts, self.follow_batch or [],
                            self.exclude_keys or [])

    def _add_masks(self, batch: Batch, num_real: int, real_nodes: Counts,
                   real_edges: Counts) -> None:
        """True for the real graphs, nodes and edges, False for the padding."""
        batch.graphs_mask = self._positions("graphs", self.opts.num_graphs) < num_real
        if isinstance(batch, HeteroData):
            assert isinstance(real_nodes, dict) and isinstance(real_edges, dict)
            assert isinstance(self.opts.num_nodes, dict)
            assert isinstance(self.opts.num_edges, dict)
            for node_type in batch.node_types:
                positions = self._positions(node_type, self.opts.num_nodes[node_type])
                batch[node_type].nodes_mask = positions < real_nodes.get(node_type, 0)
            for edge_type in batch.edge_types:
                positions = self._positions(edge_type, self.opts.num_edges[edge_type])
                batch[edge_type].edges_mask = positions < real_edges.get(edge_type, 0)
            return
        assert isinstance(self.opts.num_nodes, int) and isinstance(self.opts.num_edges, int)
        assert isinstance(real_nodes, int) and isinstance(real_edges, int)
        batch.nodes_mask = self._positions("nodes", self.opts.num_nodes) < real_nodes
        batch.edges_mask = self._positions("edges", self.opts.num_edges) < real_edges

    def _positions(self, what: Any, count: int) -> torch.Tensor:
        """``arange(count)``, made once per collater (masks compare against it)."""
        positions = self._aranges.get(what)
        if positions is None or positions.numel() != count:
            positions = self._aranges[what] = torch.arange(count)
        return positions

    # -- trimming ---------------------------------------------------------------------
    def _trimmed(self, data_list: list[BaseData], has_padding_graph: bool,
                 levels: Infos) -> list[BaseData]:
        if self.trim_nodes:
            limit = _reserve_padding_node(self.opts.num_nodes, len(data_list),
                                          has_padding_graph)
            data_list = self._prune_nodes(data_list, limit, levels)
        if self.trim_edges:
            data_list = self._prune_edges(data_list, levels=levels)
        return data_list

    def _prune_nodes(self, data_list: list[BaseData], limit: Counts | None = None,
                     levels: Infos | None = None) -> list[BaseData]:
        """``data_list`` with random nodes removed to at most ``limit`` (default: the
        options' number of nodes)."""
        if levels is None:
            levels = classify(data_list, self.exclude_keys, measure(data_list))
        return trim_nodes(data_list, self.opts.num_nodes if limit is None else limit, levels)

    def _prune_edges(self, data_list: list[BaseData], limit: Counts | None = None,
                     levels: Infos | None = None) -> list[BaseData]:
        """``data_list`` with random edges removed to at most ``limit`` (default: the
        options' number of edges)."""
        if levels is None:
            levels = classify(data_list, self.exclude_keys, measure(data_list))
        return trim_edges(data_list, self.opts.num_edges if limit is None else limit, levels)

    def _fitting(self, data_list: list[BaseData]) -> list[BaseData]:
        """The graphs of ``data_list`` that fit, taken in order, each leaving a node and
        an edge (per type) for the padding graph."""
        kept: list[BaseData] = []
        first_nodes, first_edges = measure(data_list[:1]).totals()
        nodes, edges = _zero(first_nodes), _zero(first_edges)
        for data in data_list:
            more_nodes, more_edges = measure([data]).totals()
            new_nodes, new_edges = _add(nodes, more_nodes), _add(edges, more_edges)
            if _within(new_nodes, self.opts.num_nodes) and \
                    _within(new_edges, self.opts.num_edges):
                kept.append(data)
                nodes, edges = new_nodes, new_edges
        if not kept:
            raise RuntimeError(
                "OverSizeStrategy.Skip: none of the batch's graphs fits in the fixed size "
                f"({self.opts!r}) with room for a padding graph; a batch needs at least "
                "one real graph. Increase the fixed sizes.")
        return kept

    # -- padding ----------------------------------------------------------------------
    def _check_fits(self, pad_nodes: Counts, pad_edges: Counts, num_real: int) -> None:
        for what, pad, limit in (("nodes", pad_nodes, self.opts.num_nodes),
                                 ("edges", pad_edges, self.opts.num_edges)):
            items = pad.items() if isinstance(pad, dict) else [(None, pad)]
            for type_key, missing in items:
                if missing < 0:
                    typed = what if type_key is None else f"{type_key} {what}"
                    type_limit = limit[type_key] if isinstance(limit, dict) else limit
                    raise RuntimeError(_OVERSIZE.format(
                        what=typed, real=num_real, graphs=self.opts.num_graphs,
                        limit=type_limit, trim=f"trim_{what}"))

    def _padding_graphs(self, data_list: list[BaseData], count: int, pad_nodes: Counts,
                        pad_edges: Counts, levels: Infos) -> list[BaseData]:
        if count == 0:
            return []
        template = data_list[0]
        nodes_per_graph = _split(pad_nodes, count)
        edges_per_graph = _split_edges(template, pad_edges, nodes_per_graph)
        return [padding_graph(template, levels, nodes, edges, self.opts, self.exclude_keys)
                for nodes, edges in zip(nodes_per_graph, edges_per_graph, strict=True)]


def _reserve_padding_node(num_nodes: Counts, num_graphs: int,
                          has_padding_graph: bool) -> Counts:
    """The node limit to trim to: one node (per type) less when a padding graph will need
    one to hold padding edges and the real graphs keep a node each."""
    def reserved(limit: int) -> int:
        return limit - 1 if has_padding_graph and limit - 1 >= num_graphs else limit

    if isinstance(num_nodes, dict):
        return {key: reserved(value) for key, value in num_nodes.items()}
    return reserved(num_nodes)


def _remaining(limit: Counts, real: Counts, what: str, data_list: list[BaseData]) -> Counts:
    """What is left of ``limit`` after the ``real`` nodes or edges (per type)."""
    if isinstance(real, dict):
        assert isinstance(limit, dict)
        missing = [key for key in real if key not in limit]
        if missing:
            kind = "Node" if what == "nodes" else "Edge"
            raise ValueError(f"{kind} type(s) {missing} exist in the data but not in the "
                             f"fixed size options. Ensure your fixed size options specify "
                             f"a `num_{what}` for every {kind.lower()} type.")
        return {key: limit[key] - value for key, value in real.items()}
    assert isinstance(limit, int)
    return limit - real


def _zero(count: Counts) -> Counts:
    return dict.fromkeys(count, 0) if isinstance(count, dict) else 0


def _add(a: Counts, b: Counts) -> Counts:
    if isinstance(a, dict) and isinstance(b, dict):
        return {key: a.get(key, 0) + b.get(key, 0) for key in a.keys() | b.keys()}
    assert isinstance(a, int) and isinstance(b, int)
    return a + b


def _within(count: Counts, limit: Counts) -> bool:
    """Whether ``count`` leaves at least one of ``limit`` free (per type)."""
    if isinstance(count, dict):
        assert isinstance(limit, dict)
        return all(value < limit.get(key, 0) for key, value in count.items())
    assert isinstance(limit, int)
    return count < limit


def _store_num_nodes(batch: Batch, num_nodes: Counts) -> None:
    if isinstance(batch, HeteroData):
        assert isinstance(num_nodes, dict)
        for node_type in batch.node_types:
            batch[node_type].num_nodes = num_nodes[node_type]
    else:
        batch.num_nodes = num_nodes


def _positive(count: Counts) -> bool:
    return any(v > 0 for v in count.values()) if isinstance(count, dict) else count > 0


def _check_padding_nodes(template: BaseData, pad_nodes: Counts, pad_edges: Counts) -> None:
    """Padding edges need a padding node at each end (of their node types)."""
    if isinstance(template, HeteroData):
        assert isinstance(pad_nodes, dict) and isinstance(pad_edges, dict)
        for edge_type, edges in pad_edges.items():
            for node_type in (edge_type[0], edge_type[-1]):
                if edges > 0 and pad_nodes.get(node_type, 0) == 0:
                    raise RuntimeError(_NO_PADDING_NODE.format(
                        edges=edges, what=f"of type {edge_type} ",
                        nodes=f"'{node_type}' nodes"))
    elif isinstance(pad_edges, int) and pad_edges > 0 and pad_nodes == 0:
        raise RuntimeError(_NO_PADDING_NODE.format(edges=pad_edges, what="", nodes="nodes"))


_NO_PADDING_NODE = ("The batch's real graphs fill all its {nodes}, so the {edges} padding "
                    "edge(s) {what}would have no padding node to connect (pointing them at "
                    "real nodes would change the model's results): increase the number of "
                    "{nodes} by at least one, or trim nodes.")


def _split(pad: Counts, pieces: int) -> list[Any]:
    if isinstance(pad, dict):
        per_type = {key: split_evenly(value, pieces) for key, value in pad.items()}
        return [{key: parts[i] for key, parts in per_type.items()} for i in range(pieces)]
    return split_evenly(pad, pieces)


def _split_edges(template: BaseData, pad_edges: Counts,
                 nodes_per_graph: list[Any]) -> list[Any]:
    """The padding edges divided evenly between the padding graphs that have nodes at
    both ends (of the edge type's node types)."""
    def split(total: int, holders: list[bool]) -> list[int]:
        parts = iter(split_evenly(total, max(1, sum(holders))))
        return [next(parts) if holds else 0 for holds in holders]

    if isinstance(pad_edges, dict):
        per_type = {
            edge_type: split(total, [bool(n.get(edge_type[0]) and n.get(edge_type[-1]))
                                     for n in nodes_per_graph])
            for edge_type, total in pad_edges.items()}
        return [{key: parts[i] for key, parts in per_type.items()}
                for i in range(len(nodes_per_graph))]
    return split(pad_edges, [bool(n) for n in nodes_per_graph])


class CombinedBatchingCollater:
    """Collates the graphs of one model call (``mini_batch_size x deviceIterations x
    replicationFactor x gradientAccumulation`` of them, as a ``poptorch.DataLoader``
    hands them over) micro-batch by micro-batch with ``collater``, then joins the
    micro-batches into one batch: each tensor is the concatenation along dimension 0 of
    the micro-batches' tensors (``edge_index`` becomes ``[2 x micro-batches, E]``), which
    the model call splits back into micro-batches.

    Counts of the joined batch (``num_nodes`` per store, ``num_graphs``) are those of
    one micro-batch, as each micro-batch will see them.

    Args:
        collater: Collates a list of graphs into a ``Batch``.
        mini_batch_size: Graphs per micro-batch. Default: all the graphs handed over
            form one micro-batch.
    """

    def __init__(self, collater: Any, mini_batch_size: int | None = None) -> None:
        super().__init__()
        self.collater = collater
        self.mini_batch_size = mini_batch_size
        self.parser = PyGArgsParser()

    def __call__(self, batch: list[BaseData]) -> Batch:
        size = len(batch) if self.mini_batch_size is None else self.mini_batch_size
        if size < 1 or len(batch) % size:
            raise AssertionError(f"Invalid batch size. Got {len(batch)} graphs and "
                                 f"`mini_batch_size={size}`: the graphs of one call must "
                                 "form whole micro-batches.")
        parts = [self.collater(batch[start:start + size])
                 for start in range(0, len(batch), size)]
        if len(parts) == 1:
            return parts[0]
        tensors = [list(self.parser.yieldTensors(part)) for part in parts]
        _check_same_shapes(parts[0], tensors)
        combined = self.parser.reconstruct(parts[0], combine_batch_tensors_gen(tensors))
        first = parts[0]
        if isinstance(combined, HeteroData):
            for node_type in combined.node_types:
                combined[node_type].num_nodes = first[node_type].num_nodes
        else:
            combined.num_nodes = first.num_nodes
        return combined



def _check_same_shapes(first: BaseData, tensors: list[list[torch.Tensor]]) -> None:
    """The model call splits a joined tensor into equal parts along dimension 0: the
    micro-batches must have tensors of equal shapes."""
    names = [key for store in first.stores for key in sorted(store.keys())
             if isinstance(store[key], torch.Tensor)]
    for position, name in enumerate(names):
        shapes = [tuple(part[position].shape) for part in tensors]
        if len(set(shapes)) > 1:
            raise poptorch.Error(
                f"The micro-batches of one model call have different shapes for '{name}' "
                f"({shapes}): joined along dimension 0 they could not be split back into "
                "micro-batches. Give every micro-batch the same shapes: pad the graphs "
                "(torch_geometric.transforms.Pad) or use FixedSizeDataLoader.")
