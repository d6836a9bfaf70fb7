"""PyG's ``fps`` signature (batch vector) on top of ``poptorch.fps`` (pointer list)."""
from __future__ import annotations

import numbers

import torch

import poptorch

from ._points import OpArgumentError, batch_vector

__all__ = ["fps"]


def fps(x: torch.Tensor, batch: torch.Tensor | None = None,
        ratio: float | torch.Tensor = 0.5, random_start: bool = True,
        batch_size: int | None = None) -> torch.Tensor:
    """Farthest point sampling per example, as ``torch_geometric.nn.fps``.

    ``batch`` (sorted) assigns points to examples; ``ceil(ratio * n)`` points are
    picked from an example of ``n`` points, starting from its first point, or a random
    one with ``random_start``. Returns the picked indexes into ``x``, example by
    example. ``batch_size`` (the number of examples) adds empty trailing examples.
    """
    if not isinstance(x, torch.Tensor) or x.dim() == 0:
        raise OpArgumentError("fps: x must be a tensor of points with shape [N, D].")
    if isinstance(ratio, torch.Tensor):
        if ratio.numel() != 1:
            raise OpArgumentError("fps: ratio must be a number or a one-element tensor, "
                                  f"got a tensor of shape {tuple(ratio.shape)}.")
        ratio = float(ratio.item())
    if isinstance(ratio, bool) or not isinstance(ratio, numbers.Real):
        raise OpArgumentError(f"fps: ratio must be a number in (0, 1], got {ratio!r}.")
    src = x.reshape(x.shape[0], -1) if x.dim() > 2 else x
    num = src.shape[0]
    if batch is None:
        ptr = [0, num]
    else:
        index = batch_vector(batch, num, "batch", "fps", src.device)
        if num > 1 and bool((index[1:] < index[:-1]).any()):
            raise OpArgumentError("fps: batch must be sorted (the points of each example "
                                  "next to each other, examples in order).")
        counts = torch.bincount(index, minlength=batch_size or 0)
        ptr = [0, *torch.cumsum(counts, 0).tolist()]
    return poptorch.fps(src, ptr, float(ratio), bool(random_start))
