"""Which attributes of a batch's graphs are node-, edge- or graph-level.

Padding and trimming need to know, for every attribute, whether it has a row per node,
per edge or per graph. PyG decides that on one graph by comparing sizes (and, when a
graph has as many nodes as edges, by the key's name); a batch can tell more, as its
graphs have different sizes. A collater keeps what a batch showed for sure and does not
ask again; a later batch whose sizes contradict it is caught when the padded batch is
checked (``check_padded``) and classified afresh.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch_geometric.data import HeteroData
from torch_geometric.data.data import BaseData

from .sizes import GraphSizes

__all__ = [
    "EDGE_LEVEL_KEYS",
    "AttributeInfo",
    "Infos",
    "Level",
    "check_padded",
    "classify",
    "store_types",
]

Level = Literal["node", "edge", "graph"]

EDGE_LEVEL_KEYS = frozenset({"e_id"})
"""Edge-level keys whose names do not say so (PyG decides by ``"edge" in key`` when a
graph has as many nodes as edges): ``e_id`` of PyG's sampling loaders."""


@dataclass(frozen=True)
class AttributeInfo:
    """An attribute's level, its concatenation dimension (None: not a tensor with
    rows) and whether it holds node indices (PyG shifts those when batching: padding
    fills them with the padding graph's own first node, trimming renumbers them)."""

    level: Level
    dim: int | None = None
    holds_node_indices: bool = False


Infos = dict[tuple[int, str], AttributeInfo]


def store_types(data: BaseData) -> list[Any]:
    """The type of each store of ``data.stores``: None for a graph's own (global)
    store, the node or edge type for the stores of a heterogeneous graph."""
    if isinstance(data, HeteroData):
        return [None, *data.node_types, *data.edge_types]
    return [None]


def classify(data_list: Sequence[BaseData], exclude_keys: Sequence[str], sizes: GraphSizes,
             known: Infos | None = None) -> Infos:
    """The :class:`AttributeInfo` of every attribute (by store index in ``data.stores``
    and key) of ``data_list``'s graphs.

    A tensor attribute is node-level if its size along its concatenation dimension is
    every graph's number of nodes, edge-level if it is every graph's number of edges,
    graph-level otherwise; the first graph decides when its size matches just one of its
    counts and is not 1, else every graph is looked at. Where both counts fit every
    graph, PyG's decision stands (``"edge"`` in the key, or ``e_id``). A heterogeneous
    graph's stores say their level; its global store is graph-level. Attributes in
    ``known`` are taken from it; those decided for sure here are added to it.
    """
    first = data_list[0]
    hetero = isinstance(first, HeteroData)
    infos: Infos = {}
    for index, (type_key, store) in enumerate(zip(store_types(first), first.stores,
                                                  strict=True)):
        counted_nodes = sizes.nodes.get(type_key)
        counted_edges = sizes.edges.get(type_key)
        for key, value in store.items():
            if key in exclude_keys or key == "num_nodes":
                continue
            slot = (index, key)
            if known is not None and slot in known:
                infos[slot] = known[slot]
                continue
            if (hetero and index == 0) or not isinstance(value, torch.Tensor) or \
                    value.dim() == 0:
                infos[slot] = AttributeInfo("graph")
                if known is not None:
                    known[slot] = infos[slot]
                continue
            dim = first.__cat_dim__(key, value, store)
            level, sure = _level(data_list, index, key, dim, counted_nodes, counted_edges)
            if level == "edge" and counted_nodes is not None and \
                    counted_nodes == counted_edges and key not in EDGE_LEVEL_KEYS and \
                    not store.is_edge_attr(key):
                level = "node"
            infos[slot] = AttributeInfo(level, dim, _holds_node_indices(first, key, value,
                                                                        store))
            if sure and known is not None:
                known[slot] = infos[slot]
    return infos


def _level(data_list: Sequence[BaseData], index: int, key: str, dim: int,
           counted_nodes: list[int] | None,
           counted_edges: list[int] | None) -> tuple[Level, bool]:
    """The level of one tensor attribute, and whether the batch showed it for sure."""
    size = data_list[0].stores[index][key].shape[dim]
    node_level = counted_nodes is not None and size == counted_nodes[0]
    edge_level = counted_edges is not None and size == counted_edges[0]
    if node_level != edge_level and size != 1:
        return ("node" if node_level else "edge"), True
    found = [data.stores[index][key].shape[dim] for data in data_list]
    node_level = counted_nodes is not None and found == counted_nodes
    edge_level = counted_edges is not None and found == counted_edges
    if node_level and edge_level:
        return "edge", False  # undecided: the caller applies PyG's rule
    if node_level or edge_level:
        return ("node" if node_level else "edge"), True
    return "graph", True


def _holds_node_indices(first: BaseData, key: str, value: torch.Tensor, store: Any) -> bool:
    if key == "edge_index" or "index" in key or key == "face":
        return True
    increment = first.__inc__(key, value, store)
    if isinstance(increment, torch.Tensor):
        return bool(increment.ne(0).any())
    return bool(increment)


def check_padded(batch: BaseData, infos: Infos, num_nodes: Any, num_edges: Any) -> bool:
    """Whether every node- and edge-level tensor of the padded ``batch`` has the fixed
    number of rows (a wrong level would give it another number)."""
    for (index, key), info in infos.items():
        if info.level == "graph" or info.dim is None:
            continue
        type_key = store_types(batch)[index]
        counts = num_nodes if info.level == "node" else num_edges
        expected = counts[type_key] if isinstance(counts, dict) else counts
        value = batch.stores[index].get(key)
        if isinstance(value, torch.Tensor) and value.shape[info.dim] != expected:
            return False
    return True
