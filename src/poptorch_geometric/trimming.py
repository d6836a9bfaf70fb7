"""Trimming: removing random nodes or edges from the graphs of a batch that is too large
for its fixed size (``OverSizeStrategy.TrimNodes`` / ``TrimEdges``).

Node trimming keeps at least one node of every graph that has nodes (so no graph
disappears) and removes the edges of the removed nodes; edge trimming keeps every node.
Which nodes and edges go is drawn from torch's global random generator.

Homogeneous graphs are cut with the attribute levels of the whole batch
(``levels.classify``): PyG's own ``subgraph`` decides by the name of a key
when a graph has as many nodes as edges, and would cut ``e_id`` as a node attribute.
"""
from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch
from torch_geometric.data import Data, HeteroData
from torch_geometric.data.data import BaseData

from .levels import Infos

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


def trim_nodes(data_list: list[BaseData], limit: int | dict[Any, int],
               levels: Infos) -> list[BaseData]:
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
    return [_subgraph(data, part, levels)
            for data, part in zip(data_list, _slices(mask, counts), strict=True)]


def trim_edges(data_list: list[BaseData], limit: int | dict[Any, int],
               levels: Infos) -> list[BaseData]:
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
    return [_edge_subgraph(data, part, levels)
            for data, part in zip(data_list, _slices(mask, counts), strict=True)]


def _check_room(limit: int, num_graphs: int, what: str) -> None:
    if limit < num_graphs:
        raise RuntimeError(f"The number of nodes to trim to ({limit}){what} is less than "
                           f"the number of graphs in the batch ({num_graphs}), which would "
                           "result in empty graphs. Increase the number of nodes.")


def _select(data: Data, levels: Infos, keep: dict[str, torch.Tensor],
            renumber: torch.Tensor | None) -> Data:
    """A copy of ``data`` with the rows ``keep[level]`` of its node- / edge-level
    tensors; node indices renumbered by ``renumber`` (old index -> new index)."""
    out = copy.copy(data)
    for key, value in data.items():
        info = levels.get((0, key))
        if not isinstance(value, torch.Tensor) or info is None or info.level not in keep \
                or info.dim is None:
            continue
        selected = value.index_select(info.dim, keep[info.level].nonzero().flatten())
        if renumber is not None and info.holds_node_indices:
            selected = renumber[selected]
        out[key] = selected
    return out


def _subgraph(data: Data, keep_nodes: torch.Tensor, levels: Infos) -> Data:
    """``data`` without the nodes outside ``keep_nodes`` and their edges."""
    if "edge_index" in data:
        edge_index = data.edge_index
        keep_edges = keep_nodes[edge_index[0]] & keep_nodes[edge_index[1]]
    else:
        keep_edges = torch.zeros(0, dtype=torch.bool)
    renumber = torch.cumsum(keep_nodes.long(), 0) - 1
    out = _select(data, levels, {"node": keep_nodes, "edge": keep_edges}, renumber)
    if "num_nodes" in data:
        out.num_nodes = int(keep_nodes.sum())
    return out


def _edge_subgraph(data: Data, keep_edges: torch.Tensor, levels: Infos) -> Data:
    """``data`` without the edges outside ``keep_edges`` (every node stays)."""
    return _select(data, levels, {"edge": keep_edges}, None)
