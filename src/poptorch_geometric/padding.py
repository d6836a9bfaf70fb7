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
from typing import Any

import torch
from torch_geometric.data import Data
from torch_geometric.data.data import BaseData

from .fixed_size_options import FixedSizeOptions
from .levels import AttributeInfo, Infos, store_types

__all__ = ["padded_value", "padding_graph", "split_evenly"]

def split_evenly(amount: int, pieces: int) -> list[int]:
    """``amount`` split in ``pieces`` parts that differ by at most one, larger first."""
    least, extra = divmod(amount, pieces)
    return [least + (1 if i < extra else 0) for i in range(pieces)]


def padding_graph(template: BaseData, infos: Infos, num_nodes: int | dict[Any, int],
                  num_edges: int | dict[Any, int], options: FixedSizeOptions,
                  exclude_keys: Sequence[str]) -> BaseData:
    """A padding graph shaped like ``template`` with ``num_nodes`` nodes and ``num_edges``
    edges (per type for a heterogeneous graph); ``infos``: the attributes' levels."""
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
            pad_store[key] = padded_value(key, value, infos[(store_index, key)], nodes,
                                           edges, options)
        if isinstance(template, Data) or type_key in template.node_types:
            pad_store.num_nodes = nodes
    return pad


def padded_value(key: str, value: Any, info: AttributeInfo, nodes: int, edges: int,
                 options: FixedSizeOptions) -> Any:
    """A padding graph's value of attribute ``key`` (``value``: the first graph's), for
    ``nodes`` padding nodes and ``edges`` padding edges."""
    if not isinstance(value, torch.Tensor):
        return options.pad_graph_defaults.get(key, value)
    if info.level == "graph" or info.dim is None:
        return value.new_full(value.shape, options.graph_pad_value)
    shape = list(value.shape)
    shape[info.dim] = nodes if info.level == "node" else edges
    fill = 0 if info.holds_node_indices else (
        options.node_pad_value if info.level == "node" else options.edge_pad_value)
    return value.new_full(shape, fill)
