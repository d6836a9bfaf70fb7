"""``knn_interpolate`` (PointNet++ feature propagation) with static shapes."""
from __future__ import annotations

import torch

from ._points import PAD, OpArgumentError, points
from .knn import knn

__all__ = ["knn_interpolate"]


def knn_interpolate(x: torch.Tensor, pos_x: torch.Tensor, pos_y: torch.Tensor,
                    batch_x: torch.Tensor | None = None,
                    batch_y: torch.Tensor | None = None, k: int = 3,
                    num_workers: int = 1) -> torch.Tensor:
    """Features at ``pos_y`` interpolated from the ``k`` nearest points of ``pos_x``.

    ``f(y) = sum_i w_i x_i / sum_i w_i`` with ``w_i = 1 / max(d(y, x_i)^2, 1e-16)`` over
    the ``k`` nearest points ``x_i`` of the same example (fewer when the example has
    fewer points; none gives ``nan``, as in PyG). The weights are constants for
    autograd; gradients flow into ``x``. Returns ``[pos_y.size(0), x.size(1)]``.
    """
    if not isinstance(x, torch.Tensor) or x.dim() == 0 or \
            x.shape[0] != points(pos_x, "pos_x", "knn_interpolate").shape[0]:
        raise OpArgumentError("knn_interpolate: x must be a tensor with one row of features "
                              "per point of pos_x.")
    assign = knn(pos_x, pos_y, k, batch_x=batch_x, batch_y=batch_y,
                 num_workers=num_workers)
    num_y = pos_y.shape[0]
    source = assign[1].view(num_y, k)
    empty = source == PAD
    source = source.clamp(min=0)
    with torch.no_grad():
        pos_x = points(pos_x, "pos_x", "knn_interpolate")
        pos_y = points(pos_y, "pos_y", "knn_interpolate").to(pos_x.dtype)
        diff = pos_x[source] - pos_y.unsqueeze(1)          # [M, k, D]
        weights = 1.0 / (diff * diff).sum(-1).clamp(min=1e-16)
        weights = weights.masked_fill(empty, 0.0).to(x.dtype)  # [M, k]
    features = x.reshape(x.shape[0], -1)[source]         # [M, k, F]
    out = (features * weights.unsqueeze(-1)).sum(1) / weights.sum(1, keepdim=True)
    return out.reshape(num_y, *x.shape[1:])
