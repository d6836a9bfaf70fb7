"""Trimming: removing random nodes or edges from the graphs of a batch that is too large
for its fixed size (``OverSizeStrategy.TrimNodes`` / ``TrimEdges``).

Node trimming keeps at least one node of every graph that has nodes (so no graph
disappears) and removes the edges of the removed nodes; edge trimming keeps every node.
Which nodes and edges go is drawn from torch's global random generator.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch_geometric.data import HeteroData
from torch_geometric.data.data import BaseData

__all__ = ["keep_mask", "trim_edges", "trim_nodes"]


def keep_mask(counts: Sequence[int], limit: int, keep_one_each: bool) -> torch.Tensor | None:
    """A boolean mask over the ``sum(counts)`` elements of consecutive graphs that keeps
    ``limit`` of them, dropping random ones (with ``keep_one_each``, never the last
    element of a graph that has any); None when nothing needs to go."""
    total = sum(counts)
    if total <= limit:
        return None
    removable = torch.ones(total, dtype=torch.bool)
    if keep_one_each:
        start = 0
        for count in counts:
            if count:
                removable[start + int(torch.randint(count, ()))] = False
            start += count
    candidates = removable.nonzero().flatten()
    drop = candidates[torch.randperm(candidates.numel())[:total - limit]]
    keep = torch.ones(total, dtype=torch.bool)
    keep[drop] = False
    return keep


def _slices(mask: torch.Tensor, counts: Sequence[int]) -> list[torch.Tensor]:
    return list(torch.split(mask, list(counts)))


def trim_nodes(data_list: list[BaseData], limit: int | dict[Any, int]) -> list[BaseData]:
    """``data_list`` with random nodes removed so that at most ``limit`` remain (per
    node type for heterogeneous graphs)."""
    if isinstance(data_list[0], HeteroData):
        masks: dict[Any, list[torch.Tensor]] = {}
        for node_type in data_list[0].node_types:
            type_limit = limit[node_type] if isinstance(limit, dict) else limit
            _check_room(type_limit, len(data_list), f" for node type {node_type}")
            counts = [data[node_type].num_nodes for data in data_list]
            mask = keep_mask(counts, type_limit, keep_one_each=True)
            if mask is not None:
                masks[node_type] = _slices(mask, counts)
        if not masks:
            return data_list
        return [data.subgraph({t: m[i] for t, m in masks.items()})
                for i, data in enumerate(data_list)]
    assert isinstance(limit, int)
    _check_room(limit, len(data_list), "")
    counts = [data.num_nodes for data in data_list]
    mask = keep_mask(counts, limit, keep_one_each=True)
    if mask is None:
        return data_list
    return [data.subgraph(part) for data, part in zip(data_list, _slices(mask, counts),
                                                      strict=True)]


def trim_edges(data_list: list[BaseData], limit: int | dict[Any, int]) -> list[BaseData]:
    """``data_list`` with random edges removed so that at most ``limit`` remain (per
    edge type for heterogeneous graphs)."""
    if isinstance(data_list[0], HeteroData):
        masks: dict[Any, list[torch.Tensor]] = {}
        for edge_type in data_list[0].edge_types:
            type_limit = limit[edge_type] if isinstance(limit, dict) else limit
            counts = [data[edge_type].num_edges for data in data_list]
            mask = keep_mask(counts, type_limit, keep_one_each=False)
            if mask is not None:
                masks[edge_type] = _slices(mask, counts)
        if not masks:
            return data_list
        return [data.edge_subgraph({t: m[i] for t, m in masks.items()})
                for i, data in enumerate(data_list)]
    assert isinstance(limit, int)
    counts = [data.num_edges for data in data_list]
    mask = keep_mask(counts, limit, keep_one_each=False)
    if mask is None:
        return data_list
    return [data.edge_subgraph(part)
            for data, part in zip(data_list, _slices(mask, counts), strict=True)]


def _check_room(limit: int, num_graphs: int, what: str) -> None:
    if limit < num_graphs:
        raise RuntimeError(f"The number of nodes to trim to ({limit}){what} is less than "
                           f"the number of graphs in the batch ({num_graphs}), which would "
                           "result in empty graphs. Increase the number of nodes.")
