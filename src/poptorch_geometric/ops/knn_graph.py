"""``knn_graph`` with a static output shape, in plain torch (see ``knn``)."""
from __future__ import annotations

import torch

from ._points import (
    batch_vector,
    check_count,
    check_flow,
    distances,
    nearest_slots,
    note_unused_options,
    points,
)

__all__ = ["knn_graph"]


def knn_graph(x: torch.Tensor, k: int, batch: torch.Tensor | None = None,
              loop: bool = False, flow: str = "source_to_target", cosine: bool = False,
              num_workers: int = 1, batch_size: int | None = None) -> torch.Tensor:
    """Edges from each point to its ``k`` nearest points of the same example.

    Returns a ``[2, x.size(0) * k]`` int64 edge index (``-1`` columns where an example
    has too few points). With ``flow="source_to_target"`` row 0 holds the neighbours
    and row 1 the centre points, as in PyG. Without ``loop`` a point is never its own
    neighbour (it is left out before the ``k`` nearest are picked).
    """
    k = check_count(k, "k", "knn_graph")
    check_flow(flow, "knn_graph")
    note_unused_options("knn_graph", num_workers, batch_size)
    x = points(x, "x", "knn_graph")
    bx = batch_vector(batch, x.shape[0], "batch", "knn_graph", x.device)
    with torch.no_grad():
        dist = distances(x, x, bx, bx, bool(cosine))
        if not loop:
            eye = torch.eye(x.shape[0], dtype=torch.bool, device=x.device)
            dist = dist.masked_fill(eye, float("inf"))
        center, neighbour = nearest_slots(dist, k)
    if flow == "source_to_target":
        return torch.stack([neighbour, center], dim=0)
    return torch.stack([center, neighbour], dim=0)
