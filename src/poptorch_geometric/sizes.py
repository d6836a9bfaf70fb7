"""The numbers of nodes and edges of each graph of a batch, measured once per batch.

PyG's ``num_nodes`` / ``num_edges`` look through a graph's attributes on every call; a
batch of graphs of one data set has the same attributes in each graph, so the attribute
PyG counts with on the first graph (an explicit ``num_nodes``, ``x``, ``edge_index``, or
another attribute of the right size) is read directly from every graph. When a graph
lacks it, PyG counts them all.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch_geometric.data import HeteroData
from torch_geometric.data.data import BaseData

__all__ = ["GraphSizes", "measure"]


@dataclass
class GraphSizes:
    """Per graph, its numbers of nodes and edges: by node / edge type for heterogeneous
    graphs, under the key None otherwise."""

    nodes: dict[Any, list[int]]
    edges: dict[Any, list[int]]

    def totals(self) -> tuple[Any, Any]:
        """The batch's numbers of nodes and edges (dictionaries per type when
        heterogeneous)."""
        nodes = {key: sum(values) for key, values in self.nodes.items()}
        edges = {key: sum(values) for key, values in self.edges.items()}
        if list(nodes) == [None]:
            return nodes[None], edges[None]
        return nodes, edges


def measure(data_list: Sequence[BaseData]) -> GraphSizes:
    """The sizes of the graphs of ``data_list``."""
    first = data_list[0]
    if isinstance(first, HeteroData):
        return GraphSizes(
            nodes={t: [d[t].num_nodes or 0 for d in data_list] for t in first.node_types},
            edges={t: [d[t].num_edges for d in data_list] for t in first.edge_types})
    node_anchor = _usual_anchor(first, "num_nodes")
    edge_anchor = _usual_anchor(first, "num_edges")
    if node_anchor == ("x", 0) and edge_anchor == ("edge_index", 1):
        try:  # the usual graph: one pass over the graphs' attribute mappings
            stores = [data.stores[0] for data in data_list]
            return GraphSizes(nodes={None: [store["x"].shape[0] for store in stores]},
                              edges={None: [store["edge_index"].shape[1] for store in stores]})
        except KeyError:
            pass
    return GraphSizes(nodes={None: _counted(data_list, "num_nodes")},
                      edges={None: _counted(data_list, "num_edges")})


def _counted(data_list: Sequence[BaseData], what: str) -> list[int]:
    first = data_list[0]
    anchor = _usual_anchor(first, what)
    if anchor is None:
        expected = getattr(first, what) or 0
        anchor = _anchor(first, what, expected)
    if anchor is None:
        return [getattr(d, what) or 0 for d in data_list]
    key, dim = anchor
    try:
        values = [data.stores[0][key] for data in data_list]
    except KeyError:  # a graph without the attribute: PyG counts
        return [getattr(data, what) or 0 for data in data_list]
    return values if dim is None else [value.shape[dim] for value in values]


def _usual_anchor(first: BaseData, what: str) -> tuple[str, int | None] | None:
    """An explicit count, or features ``x`` of shape [nodes, F] / an ``edge_index`` of
    shape [2, edges]: what PyG counts with in the usual graph."""
    store = first.stores[0]
    if store.get(what) is not None:
        return what, None
    common = store.get("x" if what == "num_nodes" else "edge_index")
    if isinstance(common, torch.Tensor) and common.dim() == 2 and not common.is_sparse:
        return ("x", 0) if what == "num_nodes" else ("edge_index", 1)
    return None


def _anchor(first: BaseData, what: str, expected: int) -> tuple[str, int | None] | None:
    """The attribute (and its dimension) that gives the first graph's count, as PyG
    finds it; None when there is none to read directly."""
    for key, value in first.items():
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            dim = first.__cat_dim__(key, value)
            if value.shape[dim] == expected and (
                    (what == "num_nodes" and key in ("x", "pos", "feat", "batch", "n_id"))
                    or (what == "num_edges" and key in ("edge_index", "edge_attr",
                                                        "edge_weight", "e_id"))):
                return key, dim
    return None
