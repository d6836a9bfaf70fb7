"""Neighbour sampling in torch, for a PyG without its compiled samplers.

PyG 2.8's ``NeighborSampler`` samples with pyg-lib or torch-sparse and raises an
``ImportError`` without them. :class:`TorchNeighborSampler` is that sampler with the
sampling step (``_sample``) written with torch operations, with the semantics of
torch-sparse's ``neighbor_sample``: each hop takes, for every node reached in the
previous hop, up to ``num_neighbors[hop]`` of its incoming edges at random (all of them
for ``-1``), adds the new source nodes in the order they are found, and returns the
sampled edges (``"directional"``) or all edges between the sampled nodes
(``"induced"``); ``"bidirectional"`` is PyG's own conversion of the directional
result. Temporal, weighted and disjoint sampling need pyg-lib: they raise an error that
says so.
"""
from __future__ import annotations

import warnings
from typing import Any

import torch
from torch_geometric.sampler import HeteroSamplerOutput, NeighborSampler, SamplerOutput
from torch_geometric.sampler.base import SubgraphType

__all__ = ["TorchNeighborSampler", "sample_incoming"]

_NEEDS_PYG_LIB = ("{what} needs pyg-lib (https://github.com/pyg-team/pyg-lib), which is "
                  "not installed: poptorch_geometric samples neighbours in torch only "
                  "without temporal, weighted or disjoint sampling.")


class TorchNeighborSampler(NeighborSampler):
    """PyG's ``NeighborSampler`` (same arguments) sampling in torch; see the module
    docstring. Draws from torch's global random generator."""

    def __init__(self, data: Any, num_neighbors: Any, *args: Any, **kwargs: Any) -> None:
        with warnings.catch_warnings():
            # PyG warns that its own sampling without pyg-lib is deprecated: this class
            # replaces that sampling
            warnings.filterwarnings("ignore", message=".*without a 'pyg-lib' installation")
            super().__init__(data, num_neighbors, *args, **kwargs)
        if self.sample_direction != "forward":
            raise ValueError("TorchNeighborSampler samples forward (incoming edges) only.")
        if self.is_temporal:
            raise ImportError(_NEEDS_PYG_LIB.format(what="Temporal neighbour sampling"))
        if self._disjoint:
            raise ImportError(_NEEDS_PYG_LIB.format(what="Disjoint neighbour sampling"))
        if self.edge_weight is not None:
            raise ImportError(_NEEDS_PYG_LIB.format(what="Weighted neighbour sampling"))

    def _sample(self, seed: Any, seed_time: Any = None,
                **kwargs: Any) -> SamplerOutput | HeteroSamplerOutput:
        if seed_time is not None:
            raise ImportError(_NEEDS_PYG_LIB.format(what="Temporal neighbour sampling"))
        induced = self.subgraph_type == SubgraphType.induced
        if isinstance(seed, dict):
            return self._sample_hetero(seed, induced)
        graph = _Graph({None: self.num_nodes})
        graph.add_seeds(None, seed)
        relation = (None, None, None)
        for hop_neighbors in self.num_neighbors.get_mapped_values():
            graph.hop({relation: (self.colptr, self.row, hop_neighbors)}, self.replace)
        if induced:
            graph.induce({relation: (self.colptr, self.row)})
        rows, cols, edges = graph.sampled([relation])
        return SamplerOutput(
            node=graph.nodes(None), row=rows[relation], col=cols[relation],
            edge=edges[relation], batch=None,
            num_sampled_nodes=None if induced else graph.sampled_nodes[None],
            num_sampled_edges=None if induced else graph.sampled_edges.get(relation, []))

    def _sample_hetero(self, seed: dict[Any, torch.Tensor],
                       induced: bool) -> HeteroSamplerOutput:
        graph = _Graph(dict(self.num_nodes))
        for node_type, nodes in seed.items():
            graph.add_seeds(node_type, nodes)
        values = self.num_neighbors.get_mapped_values(self.edge_types)
        structure = {edge_type: (self.colptr_dict[rel], self.row_dict[rel])
                     for edge_type, rel in self.to_rel_type.items()}
        for hop in range(self.num_neighbors.num_hops):
            graph.hop({edge_type: (*structure[edge_type],
                                   values[self.to_rel_type[edge_type]][hop])
                       for edge_type in self.edge_types}, self.replace)
        if induced:
            graph.induce(structure)
        rows, cols, edges = graph.sampled(self.edge_types)
        return HeteroSamplerOutput(
            node={t: graph.nodes(t) for t in self.node_types}, row=rows, col=cols,
            edge=edges, batch=None,
            num_sampled_nodes=None if induced else graph.sampled_nodes,
            num_sampled_edges=None if induced else graph.sampled_edges)


def sample_incoming(colptr: torch.Tensor, targets: torch.Tensor, count: int,
                    replace: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """For each node of ``targets``, up to ``count`` of its incoming edges (CSC
    positions, ``colptr`` being the CSC pointer) drawn at random: all of them for
    ``count < 0``, ``count`` with replacement, else ``min(count, degree)`` distinct
    ones. Returns ``(edge positions, number drawn per target)``."""
    start = colptr[targets]
    degree = colptr[targets + 1] - start
    if count < 0:
        drawn = degree
        offsets = _ranges(degree)
    elif replace:
        drawn = torch.where(degree > 0, count, 0)
        scale = torch.repeat_interleave(degree, drawn)
        offsets = (torch.rand(scale.numel()) * scale).long().clamp_max(scale - 1)
    else:
        drawn = degree.clamp_max(count)
        # a random order within each target's edges: sort by target, then random key
        segment = torch.repeat_interleave(torch.arange(targets.numel()), degree)
        order = torch.argsort(segment.double() + torch.rand(segment.numel(),
                                                            dtype=torch.float64))
        position = torch.arange(segment.numel()) - torch.repeat_interleave(
            torch.cumsum(degree, 0) - degree, degree)
        within = _ranges(degree)[order]
        keep = position < torch.repeat_interleave(drawn, degree)
        offsets = within[keep]
    return torch.repeat_interleave(start, drawn) + offsets, drawn


def _ranges(lengths: torch.Tensor) -> torch.Tensor:
    """``arange(l)`` for each ``l`` of ``lengths``, concatenated."""
    total = int(lengths.sum())
    starts = torch.repeat_interleave(torch.cumsum(lengths, 0) - lengths, lengths)
    return torch.arange(total) - starts


class _Graph:
    """The nodes reached so far (per node type) and their local numbering, the edges
    sampled per relation ``(src, rel, dst)``, and the per-hop counts."""

    def __init__(self, num_nodes: dict[Any, int]) -> None:
        self._local = {t: torch.full((n,), -1, dtype=torch.long) for t, n in num_nodes.items()}
        self._global = {t: torch.empty(0, dtype=torch.long) for t in num_nodes}
        self._frontier = {t: torch.empty(0, dtype=torch.long) for t in num_nodes}
        self._rows: dict[Any, list[torch.Tensor]] = {}
        self._cols: dict[Any, list[torch.Tensor]] = {}
        self._edges: dict[Any, list[torch.Tensor]] = {}
        self.sampled_nodes: dict[Any, list[int]] = {t: [] for t in num_nodes}
        self.sampled_edges: dict[Any, list[int]] = {}

    def nodes(self, node_type: Any) -> torch.Tensor:
        """The global indices of the nodes of ``node_type``, in local order."""
        return self._global[node_type]

    def sampled(self, keys: list[Any]) -> tuple[dict[Any, torch.Tensor], ...]:
        """The local source indices, local target indices and CSC edge positions of the
        sampled edges of each relation of ``keys``."""
        def joined(parts: dict[Any, list[torch.Tensor]]) -> dict[Any, torch.Tensor]:
            return {key: torch.cat(parts[key]) if parts.get(key)
                    else torch.empty(0, dtype=torch.long) for key in keys}

        return joined(self._rows), joined(self._cols), joined(self._edges)

    def add_seeds(self, node_type: Any, seeds: torch.Tensor) -> None:
        """The seeds come first, in their order (a repeated seed keeps the local index
        of its first occurrence)."""
        seeds = seeds.long()
        first = torch.full_like(self._local[node_type], seeds.numel())
        first.scatter_reduce_(0, seeds, torch.arange(seeds.numel()), "amin")
        self._local[node_type][seeds] = first[seeds]
        self._global[node_type] = seeds
        self._frontier[node_type] = torch.arange(seeds.numel())
        self.sampled_nodes[node_type].append(seeds.numel())

    def _add_new(self, node_type: Any, found: torch.Tensor) -> torch.Tensor:
        """Numbers the nodes of ``found`` not reached before, in order of first
        occurrence; returns their local indices."""
        local = self._local[node_type]
        unseen = found[local[found] < 0]
        if unseen.numel() == 0:
            return torch.empty(0, dtype=torch.long)
        unique, inverse = torch.unique(unseen, return_inverse=True)
        first = torch.full((unique.numel(),), unseen.numel(), dtype=torch.long)
        first.scatter_reduce_(0, inverse, torch.arange(unseen.numel()), "amin")
        new = unique[torch.argsort(first)]
        start = self._global[node_type].numel()
        indices = torch.arange(start, start + new.numel())
        local[new] = indices
        self._global[node_type] = torch.cat([self._global[node_type], new])
        return indices

    def hop(self, relations: dict[Any, tuple[torch.Tensor, torch.Tensor, int]],
            replace: bool) -> None:
        """One hop over every relation ``(src, rel, dst): (colptr, row, count)``: from
        the nodes the previous hop reached."""
        sampled = []
        for key, (colptr, row, count) in relations.items():
            targets = self._frontier[key[-1]]
            positions, drawn = sample_incoming(colptr, self.nodes(key[-1])[targets], count,
                                               replace)
            sampled.append((key, row[positions], torch.repeat_interleave(targets, drawn),
                            positions))
        for node_type in self._local:
            found = [sources for key, sources, _, _ in sampled if key[0] == node_type]
            new = (self._add_new(node_type, torch.cat(found)) if found
                   else torch.empty(0, dtype=torch.long))
            self._frontier[node_type] = new
            self.sampled_nodes[node_type].append(new.numel())
        for key, sources, targets, positions in sampled:
            self._rows.setdefault(key, []).append(self._local[key[0]][sources])
            self._cols.setdefault(key, []).append(targets)
            self._edges.setdefault(key, []).append(positions)
            self.sampled_edges.setdefault(key, []).append(positions.numel())

    def induce(self, relations: dict[Any, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Replaces the sampled edges by all edges between the reached nodes."""
        for key, (colptr, row) in relations.items():
            targets = self.nodes(key[-1])
            positions, drawn = sample_incoming(colptr, targets, -1, False)
            sources = self._local[key[0]][row[positions]]
            keep = sources >= 0
            local_targets = torch.repeat_interleave(torch.arange(targets.numel()), drawn)
            self._rows[key] = [sources[keep]]
            self._cols[key] = [local_targets[keep]]
            self._edges[key] = [positions[keep]]
