"""``radius`` and ``radius_graph`` with static output shapes, in plain torch.

The result has ``max_num_neighbors`` slots per query point whatever the data; a slot
without a neighbour holds ``-1`` in both rows. When more points lie within ``r`` than
there are slots, the nearest ones are kept (PyG keeps an unspecified subset).
"""
from __future__ import annotations

import numbers

import torch

from ._points import (
    OpArgumentError,
    batch_vector,
    check_count,
    check_flow,
    distances,
    nearest_slots,
    note_unused_options,
    point_pair,
    points,
)

__all__ = ["radius", "radius_graph"]


def _check_radius(r: object, op: str) -> float:
    if isinstance(r, bool) or not isinstance(r, numbers.Real) or not float(r) >= 0:
        raise OpArgumentError(f"{op}: r must be a number >= 0, got {r!r}.")
    return float(r)


def radius(x: torch.Tensor, y: torch.Tensor, r: float, batch_x: torch.Tensor | None = None,
           batch_y: torch.Tensor | None = None, max_num_neighbors: int = 32,
           num_workers: int = 1, batch_size: int | None = None) -> torch.Tensor:
    """For each point of ``y``, the points of ``x`` of the same example within distance
    ``r`` (Euclidean, ``<= r``).

    Returns a ``[2, y.size(0) * max_num_neighbors]`` int64 tensor: row 0 the index into
    ``y``, row 1 the index into ``x``, nearest first; ``-1`` in both rows for unused
    slots. ``batch_x`` / ``batch_y`` give each point's example (``None``: one example;
    sorting is not required). ``num_workers`` and ``batch_size`` are accepted for PyG's
    signature and have no effect.
    """
    r = _check_radius(r, "radius")
    slots = check_count(max_num_neighbors, "max_num_neighbors", "radius")
    note_unused_options("radius", num_workers, batch_size)
    x, y, bx, by = point_pair(x, y, batch_x, batch_y, "radius")
    with torch.no_grad():
        row, col = nearest_slots(distances(x, y, bx, by), slots, within=r)
    return torch.stack([row, col], dim=0)


def radius_graph(x: torch.Tensor, r: float, batch: torch.Tensor | None = None,
                 loop: bool = False, max_num_neighbors: int = 32,
                 flow: str = "source_to_target", num_workers: int = 1,
                 batch_size: int | None = None) -> torch.Tensor:
    """Edges between the points of the same example within distance ``r``.

    Returns a ``[2, x.size(0) * max_num_neighbors]`` int64 edge index with ``-1``
    columns for unused slots. With ``flow="source_to_target"`` row 0 holds the
    neighbours and row 1 the centre points, as in PyG. Without ``loop`` a point is never
    its own neighbour (and does not take one of its slots).
    """
    r = _check_radius(r, "radius_graph")
    slots = check_count(max_num_neighbors, "max_num_neighbors", "radius_graph")
    check_flow(flow, "radius_graph")
    note_unused_options("radius_graph", num_workers, batch_size)
    x = points(x, "x", "radius_graph")
    bx = batch_vector(batch, x.shape[0], "batch", "radius_graph", x.device)
    with torch.no_grad():
        dist = distances(x, x, bx, bx)
        if not loop:
            eye = torch.eye(x.shape[0], dtype=torch.bool, device=x.device)
            dist = dist.masked_fill(eye, float("inf"))
        center, neighbour = nearest_slots(dist, slots, within=r)
    if flow == "source_to_target":
        return torch.stack([neighbour, center], dim=0)
    return torch.stack([center, neighbour], dim=0)
