"""Point-cloud ops with the semantics of ``torch_cluster``: ``fps`` and ``nearest``."""
from __future__ import annotations

import itertools
import math

import torch

from ..errors import Error

__all__ = ["fps", "nearest"]


class NearestArgumentError(Error, ValueError):
    """Batch vectors ``nearest`` cannot use: a ``poptorch.Error`` and, as
    ``torch_cluster.nearest`` raises for them, a ``ValueError``."""


def _pointer_list(ptr: torch.Tensor | list[int] | tuple[int, ...],
                  num_points: int) -> list[int]:
    if isinstance(ptr, torch.Tensor):
        if ptr.dim() != 1 or ptr.is_floating_point():
            raise Error("fps: ptr must be a 1-D integer tensor or a list of ints.")
        ptr = ptr.tolist()
    if not isinstance(ptr, (list, tuple)) or len(ptr) < 2 or \
            not all(isinstance(p, int) and not isinstance(p, bool) for p in ptr):
        raise Error(f"fps: ptr must list at least two ints (segment boundaries such as "
                    f"[0, n0, n0 + n1, ...]), got {ptr!r}.")
    if ptr[0] < 0 or ptr[-1] > num_points or any(a > b for a, b in itertools.pairwise(ptr)):
        raise Error(f"fps: ptr={ptr!r} must be non-decreasing and within [0, {num_points}] "
                    "(the number of points in src).")
    return list(ptr)


def fps(src: torch.Tensor, ptr: torch.Tensor | list[int] | tuple[int, ...],
        ratio: float = 0.5,
        random_start: bool = False) -> torch.Tensor:
    """Farthest point sampling, as ``torch_cluster.fps`` with a ``ptr`` vector.

    Within each segment ``src[ptr[i]:ptr[i + 1]]``, ``ceil(ratio * size)`` points are
    picked: first the segment's first point (a random one with ``random_start``), then
    repeatedly the point farthest (squared Euclidean distance) from all points picked
    so far. Returns the picked indexes into ``src`` (int64), segment after segment.
    """
    if not isinstance(src, torch.Tensor) or src.dim() not in (1, 2):
        raise Error("fps: src must be a tensor of points with shape [N, D] (or [N]).")
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio <= 1:
        raise Error(f"fps: ratio must be in (0, 1], got {ratio!r}.")
    points = src.detach().reshape(src.shape[0], -1)
    picked = []
    bounds = _pointer_list(ptr, points.shape[0])
    for begin, end in itertools.pairwise(bounds):
        size = end - begin
        count = math.ceil(ratio * size)
        if count == 0:
            continue
        segment = points[begin:end]
        first = int(torch.randint(size, ())) if random_start else 0
        chosen = [first]
        dist = (segment - segment[first]).pow(2).sum(dim=1)
        for _ in range(count - 1):
            farthest = int(dist.argmax())
            chosen.append(farthest)
            dist = torch.minimum(dist, (segment - segment[farthest]).pow(2).sum(dim=1))
        picked.append(torch.tensor(chosen, dtype=torch.long) + begin)
    if not picked:
        return torch.empty(0, dtype=torch.long, device=src.device)
    return torch.cat(picked).to(src.device)


def _batch_vector(batch: torch.Tensor | list[int] | None, num: int, name: str,
                  device: torch.device) -> torch.Tensor:
    if batch is None:
        return torch.zeros(num, dtype=torch.long, device=device)
    batch = torch.as_tensor(batch, device=device)
    if batch.dim() != 1 or batch.shape[0] != num or batch.is_floating_point():
        raise NearestArgumentError(
            f"nearest: {name} must be a 1-D integer vector with one entry per point "
            f"({num}), got shape {tuple(batch.shape)}.")
    if num > 1 and bool((batch[1:] < batch[:-1]).any()):
        raise NearestArgumentError(f"nearest: {name} must be sorted.")
    return batch.long()


def nearest(x: torch.Tensor, y: torch.Tensor, batch_x: torch.Tensor | list[int] | None = None,
            batch_y: torch.Tensor | list[int] | None = None) -> torch.Tensor:
    """For each point of ``x``, the index of the nearest point of ``y`` in the same sample.

    As ``torch_cluster.nearest``: ``batch_x``/``batch_y`` (sorted; ``None`` means one
    sample) assign points to samples; distances are Euclidean; ties go to the lowest
    index. Returns an int64 tensor with one index into ``y`` per point of ``x``.
    """
    if not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor):
        raise TypeError("nearest: x and y must be tensors.")
    x2 = x.reshape(x.shape[0], -1) if x.dim() != 2 else x
    y2 = y.reshape(y.shape[0], -1) if y.dim() != 2 else y
    if x2.shape[1] != y2.shape[1]:
        raise NearestArgumentError(
            f"nearest: x and y must have the same number of features, got "
            f"{x2.shape[1]} and {y2.shape[1]}.")
    bx = _batch_vector(batch_x, x2.shape[0], "batch_x", x.device)
    by = _batch_vector(batch_y, y2.shape[0], "batch_y", x.device)
    missing = set(bx.unique().tolist()) - set(by.unique().tolist())
    if missing:
        raise NearestArgumentError(
            f"nearest: samples {sorted(missing)} have points in x but none in y.")
    dist = torch.cdist(x2.detach().double(), y2.detach().double())
    dist = dist.masked_fill(bx[:, None] != by[None, :], float("inf"))
    return dist.argmin(dim=1)
