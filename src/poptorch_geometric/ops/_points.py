"""Shared pieces of the static-shape point ops: argument checks, distances, slots.

Every op compares all pairs of points (a dense ``[M, N]`` distance matrix), masks the
pairs from different examples with ``inf`` and keeps a fixed number of slots per query
point. A slot with no neighbour holds ``-1`` in both rows of the result: the output
shape depends only on the input shapes, so a compiled program never recompiles for it.
"""
from __future__ import annotations

import numbers

import torch

from poptorch import Error
from poptorch._logging import info_once

__all__ = [
    "PAD",
    "OpArgumentError",
    "batch_vector",
    "check_count",
    "check_flow",
    "distances",
    "nearest_slots",
    "note_unused_options",
    "points",
    "without_padding",
]

PAD = -1
"""The index in both rows of an edge slot that holds no edge."""


class OpArgumentError(Error, ValueError):
    """A wrong argument to one of these ops: a ``poptorch.Error`` and, as PyG's and
    torch-cluster's own checks raise, a ``ValueError``."""


def points(tensor: torch.Tensor, name: str, op: str) -> torch.Tensor:
    """``tensor`` as a floating-point ``[N, D]`` matrix (a 1-D tensor is ``[N, 1]``)."""
    if not isinstance(tensor, torch.Tensor):
        raise OpArgumentError(f"{op}: {name} must be a tensor of points with shape [N, D], got "
                    f"{type(tensor).__name__}.")
    if tensor.dim() == 1:
        tensor = tensor.view(-1, 1)
    if tensor.dim() != 2:
        raise OpArgumentError(f"{op}: {name} must have shape [N, D] (or [N]), got "
                    f"{tuple(tensor.shape)}.")
    if tensor.dtype not in (torch.float32, torch.float64):
        tensor = tensor.float()  # integer coordinates; half precision is too coarse here
    return tensor


def batch_vector(batch: torch.Tensor | None, num: int, name: str, op: str,
                 device: torch.device) -> torch.Tensor:
    """The example index of each of ``num`` points (all zeros when ``batch`` is None).

    The vector need not be sorted: pairs are matched by example index, not by ranges.
    """
    if batch is None:
        return torch.zeros(num, dtype=torch.long, device=device)
    if not isinstance(batch, torch.Tensor):
        raise OpArgumentError(f"{op}: {name} must be a 1-D tensor of example indexes or None, got "
                    f"{type(batch).__name__}.")
    if batch.dim() != 1 or batch.shape[0] != num:
        raise OpArgumentError(f"{op}: {name} must be a 1-D vector with one example index per point "
                    f"({num}), got shape {tuple(batch.shape)}.")
    return batch.to(device=device, dtype=torch.long)


def point_pair(x: torch.Tensor, y: torch.Tensor, batch_x: torch.Tensor | None,
               batch_y: torch.Tensor | None, op: str
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The points of ``x`` and ``y`` (:py:func:`points`), checked to have the same
    number of features, and their batch vectors (:py:func:`batch_vector`)."""
    x, y = points(x, "x", op), points(y, "y", op)
    if x.shape[1] != y.shape[1]:
        raise OpArgumentError(f"{op}: x and y must have the same number of features, got "
                              f"{x.shape[1]} and {y.shape[1]}.")
    return (x, y, batch_vector(batch_x, x.shape[0], "batch_x", op, x.device),
            batch_vector(batch_y, y.shape[0], "batch_y", op, x.device))


def distances(x: torch.Tensor, y: torch.Tensor, batch_x: torch.Tensor,
              batch_y: torch.Tensor, cosine: bool = False) -> torch.Tensor:
    """``[M, N]`` distances from each point of ``y`` to each point of ``x``; ``inf``
    between points of different examples.

    Euclidean distances are computed pair by pair (no ``|a|^2 + |b|^2 - 2ab`` shortcut,
    whose rounding would reorder near ties); the cosine distance is ``1 - cos(x, y)``.
    """
    dtype = torch.promote_types(x.dtype, y.dtype)
    x, y = x.to(dtype), y.to(dtype)
    if cosine:
        unit_x = torch.nn.functional.normalize(x, dim=1)
        unit_y = torch.nn.functional.normalize(y, dim=1)
        dist = 1.0 - unit_y @ unit_x.t()
    else:
        dist = torch.cdist(y, x, compute_mode="donot_use_mm_for_euclid_dist")
    return dist.masked_fill(batch_y.view(-1, 1) != batch_x.view(1, -1), float("inf"))


def nearest_slots(dist: torch.Tensor, slots: int,
                  within: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(row, col)``, each ``[M * slots]``: for each query point (row of ``dist``) its
    ``slots`` nearest points, nearest first; ``PAD`` where there is none (a distance of
    ``inf``, or above ``within`` when given)."""
    num_queries, num_points = dist.shape
    kept = min(slots, num_points)
    if kept > 0:
        near, col = torch.topk(dist, kept, dim=1, largest=False, sorted=True)
    else:
        near = dist.new_empty(num_queries, 0)
        col = torch.empty(num_queries, 0, dtype=torch.long, device=dist.device)
    if kept < slots:  # fewer points than slots: the rest stays empty
        near = torch.cat([near, near.new_full((num_queries, slots - kept), float("inf"))], 1)
        col = torch.cat([col, col.new_full((num_queries, slots - kept), PAD)], 1)
    empty = torch.isinf(near) if within is None else ~(near <= within)
    row = torch.arange(num_queries, device=dist.device).view(-1, 1).expand(-1, slots)
    row = row.masked_fill(empty, PAD).reshape(-1)
    col = col.masked_fill(empty, PAD).reshape(-1)
    return row, col


def check_count(value: object, name: str, op: str) -> int:
    """A positive int argument (``k``, ``max_num_neighbors``)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise OpArgumentError(f"{op}: {name} must be an int >= 1, got {value!r}.")
    return int(value)


def check_flow(flow: object, op: str) -> None:
    if flow not in ("source_to_target", "target_to_source"):
        raise OpArgumentError(f"{op}: flow must be 'source_to_target' or 'target_to_source', got "
                    f"{flow!r}.")


def note_unused_options(op: str, num_workers: object, batch_size: object) -> None:
    """``num_workers`` and ``batch_size`` steer torch-cluster / pyg-lib kernels; these
    ops compute all pairs at once and need neither. Logged once at INFO."""
    if torch.compiler.is_compiling():
        return
    if num_workers != 1:
        info_once(("poptorch_geometric", op, "num_workers"),
                  "%s: num_workers=%r has no effect (the op runs as tensor operations on "
                  "the model's device)", op, num_workers)
    if batch_size is not None:
        info_once(("poptorch_geometric", op, "batch_size"),
                  "%s: batch_size=%r is not needed (examples are matched by their "
                  "batch index)", op, batch_size)


def without_padding(edge_index: torch.Tensor) -> torch.Tensor:
    """The columns of a ``[2, E]`` result that hold an edge (``PAD`` columns dropped).

    This gives PyG's own result shape, which depends on the data.
    """
    return edge_index[:, edge_index[0] != PAD]
