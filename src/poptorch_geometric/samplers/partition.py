"""Graph partitions in torch, for a PyG without METIS (pyg-lib / torch-sparse).

:func:`partition_nodes` orders the nodes breadth first, component after component
(each started from its node of least degree, as the Cuthill-McKee ordering does), and
cuts that order into ``num_parts`` runs of equal size: every part has the same number of
nodes and holds nodes close to each other in the graph. METIS minimises the edges cut
between parts; this ordering cuts more of them, which Cluster-GCN tolerates (it keeps
or drops the edges between clusters of a batch) but which makes batches lose more
edges than with METIS.
"""
from __future__ import annotations

import torch

__all__ = ["breadth_first_order", "partition_nodes"]


def breadth_first_order(edge_index: torch.Tensor, num_nodes: int) -> torch.Tensor:
    """All nodes in breadth-first order over the undirected graph of ``edge_index``,
    one connected component after another; isolated nodes last."""
    row, col = edge_index[0].long(), edge_index[1].long()
    keep = row != col
    row, col = torch.cat([row[keep], col[keep]]), torch.cat([col[keep], row[keep]])
    order_by_row = torch.argsort(row, stable=True)
    neighbors = col[order_by_row]
    degree = torch.bincount(row, minlength=num_nodes)
    indptr = torch.zeros(num_nodes + 1, dtype=torch.long)
    indptr[1:] = torch.cumsum(degree, 0)
    visited = degree == 0  # isolated nodes go last, all at once
    pieces: list[torch.Tensor] = []
    # components are started from their least connected node
    by_degree = torch.argsort(degree, stable=True)
    cursor = 0
    while True:
        while cursor < num_nodes and bool(visited[by_degree[cursor]]):
            cursor += 1
        if cursor == num_nodes:
            break
        frontier = by_degree[cursor:cursor + 1]
        visited[frontier] = True
        while frontier.numel():
            pieces.append(frontier)
            starts, counts = indptr[frontier], degree[frontier]
            offsets = torch.arange(int(counts.sum())) - torch.repeat_interleave(
                torch.cumsum(counts, 0) - counts, counts)
            reached = neighbors[torch.repeat_interleave(starts, counts) + offsets]
            reached = torch.unique(reached[~visited[reached]])
            visited[reached] = True
            frontier = reached
    pieces.append(torch.nonzero(degree == 0).flatten())
    return torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.long)


def partition_nodes(edge_index: torch.Tensor, num_nodes: int, num_parts: int) -> torch.Tensor:
    """The part (``0 .. num_parts - 1``) of every node: equal runs of the breadth-first
    order (part sizes differ by at most one node)."""
    if num_parts < 1:
        raise ValueError(f"num_parts must be at least 1, got {num_parts}.")
    order = breadth_first_order(edge_index, num_nodes)
    part = torch.empty(num_nodes, dtype=torch.long)
    part[order] = torch.arange(num_nodes) * num_parts // max(num_nodes, 1)
    return part
