"""``knn`` with a static output shape, in plain torch.

PyG 2.8 computes it in pyg-lib (and earlier PyG in torch-cluster); this needs
neither. The result has ``k`` slots per query point whatever the data; a slot without a
neighbour (the example has fewer than ``k`` points) holds ``-1`` in both rows.
"""
from __future__ import annotations

import torch

from ._points import (
    check_count,
    distances,
    nearest_slots,
    note_unused_options,
    point_pair,
)

__all__ = ["knn"]


def knn(x: torch.Tensor, y: torch.Tensor, k: int, batch_x: torch.Tensor | None = None,
        batch_y: torch.Tensor | None = None, cosine: bool = False, num_workers: int = 1,
        batch_size: int | None = None) -> torch.Tensor:
    """For each point of ``y``, the ``k`` nearest points of ``x`` in the same example.

    Returns a ``[2, y.size(0) * k]`` int64 tensor: row 0 the index into ``y``, row 1 the
    index into ``x``, nearest first, ``k`` columns per point of ``y``; ``-1`` in both
    rows where the example has fewer than ``k`` points in ``x``. ``batch_x`` /
    ``batch_y`` give each point's example (``None``: one example; sorting is not
    required). ``cosine`` ranks by ``1 - cos(x, y)`` instead of the Euclidean
    distance. ``num_workers`` and ``batch_size`` are accepted for PyG's signature and
    have no effect.
    """
    k = check_count(k, "k", "knn")
    note_unused_options("knn", num_workers, batch_size)
    x, y, bx, by = point_pair(x, y, batch_x, batch_y, "knn")
    with torch.no_grad():
        row, col = nearest_slots(distances(x, y, bx, by, bool(cosine)), k)
    return torch.stack([row, col], dim=0)
