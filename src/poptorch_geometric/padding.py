"""Padding graphs: the graphs a fixed-size batch is completed with.

A padding graph has the attributes of the batch's first graph: node-level tensors get
one row per padding node filled with ``node_pad_value``, edge-level tensors one row per
padding edge filled with ``edge_pad_value``, graph-level tensors one row filled with
``graph_pad_value``, other values come from ``pad_graph_defaults`` (else the first
graph's). Attributes that hold node indices (those PyG increments when batching, such
as ``edge_index``) are filled with 0: the padding graph's own first node, so that every
padding edge is a self-loop on a padding node and never touches a real node.
"""
from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any, Literal

import torch
from torch_geometric.data import Data, HeteroData
from torch_geometric.data.data import BaseData

from .fixed_size_options import FixedSizeOptions

__all__ = ["EDGE_LEVEL_KEYS", "Level", "attribute_levels", "padding_graph", "split_evenly",
           "store_types"]

Level = Literal["node", "edge", "graph"]


EDGE_LEVEL_KEYS = frozenset({"e_id"})
"""Edge-level keys whose names do not say so (PyG decides by ``"edge" in key`` when a
graph has as many nodes as edges): ``e_id`` of PyG's sampling loaders."""


def attribute_levels(data_list: Sequence[BaseData],
                     exclude_keys: Sequence[str] = ()) -> dict[tuple[int, str], Level]:
    """Whether each attribute (by store index in ``data.stores`` and key) is node-, edge-
    or graph-level over the whole of ``data_list``.

    A tensor attribute is node-level if its size along its concatenation dimension is
    every graph's number of nodes, edge-level if it is every graph's number of edges,
    graph-level otherwise. Where both fit in every graph (as many nodes as edges), PyG's
    decision stands (``"edge"`` in the key, or ``e_id``). The stores of a heterogeneous
    graph say which level they hold; its global store holds graph-level attributes.
    """
    first = data_list[0]
    hetero = isinstance(first, HeteroData)
    levels: dict[tuple[int, str], Level] = {}
    for index, store in enumerate(first.stores):
        stores = [data.stores[index] for data in data_list]
        counted_nodes = counted_edges = None
        for key, value in store.items():
            if key in exclude_keys or key == "num_nodes":
                continue
            if (hetero and index == 0) or not isinstance(value, torch.Tensor) or \
                    value.dim() == 0:
                levels[(index, key)] = "graph"
                continue
            dim = first.__cat_dim__(key, value, store)
            sizes = [other[key].shape[dim] for other in stores]
            node_level = edge_level = False
            if hetero:
                if index <= len(first.node_types):
                    counted_nodes = counted_nodes or [s.num_nodes or 0 for s in stores]
                    node_level = sizes == counted_nodes
                else:
                    counted_edges = counted_edges or [s.num_edges for s in stores]
                    edge_level = sizes == counted_edges
            else:
                counted_nodes = counted_nodes or [s.num_nodes or 0 for s in stores]
                counted_edges = counted_edges or [s.num_edges for s in stores]
                node_level, edge_level = sizes == counted_nodes, sizes == counted_edges
            if node_level and edge_level:
                edge_level = key in EDGE_LEVEL_KEYS or store.is_edge_attr(key)
                node_level = not edge_level
            levels[(index, key)] = "node" if node_level else "edge" if edge_level \
                else "graph"
    return levels


def split_evenly(amount: int, pieces: int) -> list[int]:
    """``amount`` split in ``pieces`` parts that differ by at most one, larger first."""
    least, extra = divmod(amount, pieces)
    return [least + (1 if i < extra else 0) for i in range(pieces)]


def padding_graph(template: BaseData, levels: dict[tuple[int, str], Level],
                  num_nodes: int | dict[Any, int], num_edges: int | dict[Any, int],
                  options: FixedSizeOptions, exclude_keys: Sequence[str]) -> BaseData:
    """A padding graph shaped like ``template`` with ``num_nodes`` nodes and ``num_edges``
    edges (per type for a heterogeneous graph); ``levels`` maps (store index, key) to
    the attribute's level."""
    pad = copy.copy(template)
    for store_index, (type_key, store, pad_store) in enumerate(
            zip(store_types(template), template.stores, pad.stores, strict=True)):
        nodes = edges = 0
        if isinstance(template, Data):
            assert isinstance(num_nodes, int) and isinstance(num_edges, int)
            nodes, edges = num_nodes, num_edges
        elif isinstance(num_nodes, dict) and type_key in num_nodes:
            nodes = num_nodes[type_key]
        elif isinstance(num_edges, dict) and type_key in num_edges:
            edges = num_edges[type_key]
        for key, value in store.items():
            if key in exclude_keys or key == "num_nodes":
                continue
            pad_store[key] = _padded_value(template, store, key, value,
                                           levels[(store_index, key)], nodes, edges,
                                           options)
        if isinstance(template, Data) or type_key in template.node_types:
            pad_store.num_nodes = nodes
    return pad


def store_types(data: BaseData) -> list[Any]:
    """The type of each store of ``data.stores``: None for a graph's own (global)
    store, the node or edge type for the stores of a heterogeneous graph."""
    if isinstance(data, HeteroData):
        return [None, *data.node_types, *data.edge_types]
    return [None]


def _padded_value(template: BaseData, store: Any, key: str, value: Any, level: Level,
                  nodes: int, edges: int, options: FixedSizeOptions) -> Any:
    if not isinstance(value, torch.Tensor):
        return options.pad_graph_defaults.get(key, value)
    if level == "graph":
        return value.new_full(value.shape, options.graph_pad_value)
    shape = list(value.shape)
    dim = template.__cat_dim__(key, value, store)
    shape[dim] = nodes if level == "node" else edges
    holds_node_indices = bool(_increment(template, key, value, store))
    fill = 0 if holds_node_indices else (
        options.node_pad_value if level == "node" else options.edge_pad_value)
    return value.new_full(shape, fill)


def _increment(template: BaseData, key: str, value: torch.Tensor, store: Any) -> Any:
    """How much PyG shifts ``key`` per preceding graph when batching (non-zero for
    attributes holding node indices)."""
    increment = template.__inc__(key, value, store)
    if isinstance(increment, torch.Tensor):
        return bool(increment.ne(0).any())
    return increment
