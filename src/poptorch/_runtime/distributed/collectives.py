"""Coalesced collectives: many small tensors travel as a few flat buffers.

One collective per tensor costs a round trip each; PyTorch's DDP packs gradients into
buckets for the same reason. Tensors are grouped by (device, dtype) into buckets of at
most ``BUCKET_BYTES`` and each bucket is sent as one flat tensor.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..device_faults import collective_failure
from ..torch_internals import foreach_copy_

BUCKET_BYTES = 25 * 1024 * 1024  # DDP's default bucket size


def buckets(tensors: Sequence[torch.Tensor]) -> list[list[int]]:
    """Indices of ``tensors`` grouped by device and dtype into buckets of bounded size
    (each tensor in exactly one bucket, in order within a bucket)."""
    open_buckets: dict = {}  # (device, dtype) -> [indices, bytes] of the filling bucket
    result: list[list[int]] = []
    for i, t in enumerate(tensors):
        size = t.nbytes
        bucket = open_buckets.get((t.device, t.dtype))
        if bucket is None or (bucket[0] and bucket[1] + size > BUCKET_BYTES):
            bucket = open_buckets[(t.device, t.dtype)] = [[], 0]
            result.append(bucket[0])
        bucket[0].append(i)
        bucket[1] += size
    return result


# Where a communication failure surfaces inside other code (DDP's all-reduces run in
# backward hooks and reach Python as a plain RuntimeError), the backend's own words tell it
# apart from an error of the model.
_BACKEND_MARKS = ("gloo", "NCCL", "nccl", "ProcessGroup", "c10d")


def is_communication_failure(exc: BaseException) -> bool:
    """True if ``exc`` comes from the communication backend, not from the model."""
    dist_error = getattr(dist, "DistError", None)
    if dist_error is not None and isinstance(exc, dist_error):
        return True
    return isinstance(exc, RuntimeError) and any(m in str(exc) for m in _BACKEND_MARKS)


@contextlib.contextmanager
def failures_as_errors(what: str, runs_model: bool = False) -> Iterator[None]:
    """Turn a failed collective (a process died, the network broke, the timeout
    expired) into PopTorch's error that says so (``device_faults``: mostly a
    :py:class:`poptorch.RecoverableError`, ``recovery_action`` "PARTITION_RESET"). Around
    code that also runs the model (``runs_model``), only the communication backend's
    errors are turned."""
    try:
        yield
    except RuntimeError as exc:
        if runs_model and not is_communication_failure(exc):
            raise
        raise collective_failure(what, exc) from exc


def _flat_buckets(tensors: Sequence[torch.Tensor]
                  ) -> Iterator[tuple[list[int], list[torch.Tensor], torch.Tensor,
                                      list[torch.Tensor]]]:
    """Per bucket: its indices, its tensors, them concatenated into one flat tensor, and
    views of that tensor shaped as them."""
    for bucket in buckets(tensors):
        members = [tensors[i] for i in bucket]
        flat = torch.cat([t.reshape(-1) for t in members])
        chunks = flat.split([t.numel() for t in members])
        yield bucket, members, flat, [c.view_as(t) for c, t in zip(chunks, members, strict=True)]


def broadcast_(tensors: Sequence[torch.Tensor], group: dist.ProcessGroup | None,
               src: int = 0) -> None:
    """Overwrite ``tensors`` on every process with process ``src``'s values."""
    if not tensors:
        return
    with torch.no_grad(), failures_as_errors("Broadcasting tensors"):
        for _, members, flat, views in _flat_buckets(tensors):
            dist.broadcast(flat, src=src, group=group)
            foreach_copy_(members, views)


def all_reduce_sum(tensors: Sequence[torch.Tensor], group: dist.ProcessGroup | None
                   ) -> list[torch.Tensor]:
    """The sums over all processes of ``tensors``, as views into flat buffers (the
    inputs are not modified). All buckets are in flight at once."""
    if not tensors:
        return []
    with failures_as_errors("Summing gradients"):
        pending = [(bucket, views, dist.all_reduce(flat, group=group, async_op=True))
                   for bucket, _, flat, views in _flat_buckets(tensors)]
    result: list[Any] = [None] * len(tensors)
    with failures_as_errors("Summing gradients"):
        for bucket, views, work in pending:
            work.wait()
            for i, view in zip(bucket, views, strict=True):
                result[i] = view
    return result
