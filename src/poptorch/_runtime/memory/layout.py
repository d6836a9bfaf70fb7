"""Which replica holds which part of each optimizer state tensor.

PopTorch's replicated tensor sharding splits a tensor's optimizer state over the replicas
that share the tensor: every replica of the run for a plain weight, the replicas of one
group for each group's slice of a replica-grouped weight (``replicaGrouping``). A tensor
with fewer than ``minElementsForReplicatedTensorSharding`` elements stays whole on every
replica.

A :py:class:`Piece` is a contiguous range of a parameter's flat elements owned by one
global replica (``process * r + local replica``). For optimizers whose update is
elementwise (SGD, Adam, AdamW, RMSprop):

* weights shared by every replica are laid end to end in *buckets* (consecutive
  parameters of one dtype and device, about ``BUCKET_ELEMENTS`` elements), each padded to
  a multiple of the replica count and cut into equal ranges, range ``k`` owned by
  replica ``k`` (FSDP's flat parameter): a process owns one contiguous range of each
  bucket, so the weights can live in the bucket (``sharding``) and be all-gathered in
  place;
* each slice of a replica-grouped weight is cut into balanced pieces (as
  ``torch.tensor_split``), one per replica of its group.

Other optimizers (LAMB's trust ratio is a norm over the whole tensor) get each whole
tensor owned by one replica, tensors assigned to the least loaded replica (the
partitioning of ``torch.distributed.optim.ZeroRedundancyOptimizer``).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

# PopART's default of minElementsForReplicatedTensorSharding.
DEFAULT_MIN_ELEMENTS = 8192
# Elements of a bucket of weights gathered by one collective (8 MiB of float32).
BUCKET_ELEMENTS = 2 * 1024 * 1024


@dataclass(frozen=True)
class Piece:
    """Elements ``[start, end)`` of flat parameter ``param``, owned by global replica
    ``owner``; ``whole``: the piece is the whole tensor, updated in its own shape."""

    param: int
    start: int
    end: int
    owner: int
    whole: bool = False
    bucket: int = -1  # the bucket holding the piece, -1 for none

    @property
    def numel(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Bucket:
    """Parameters ``params`` laid end to end at ``offsets``, padded to ``length``
    elements: ``length / replicas`` elements per replica."""

    params: tuple
    offsets: tuple
    length: int


@dataclass
class ShardLayout:
    """The pieces of the sharded parameters and the parameters every replica keeps
    whole (``replicated``); ``replicas_per_process`` maps an owner to its process."""

    pieces: list[Piece]
    replicated: list[int]
    replicas_per_process: int
    processes: int
    buckets: list[Bucket] = field(default_factory=list)
    by_param: dict[int, list[Piece]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for piece in self.pieces:
            self.by_param.setdefault(piece.param, []).append(piece)

    def process_of(self, piece: Piece) -> int:
        """The process holding ``piece``'s optimizer state."""
        return piece.owner // self.replicas_per_process

    def local(self, process: int) -> list[Piece]:
        """The pieces whose optimizer state ``process`` holds (in canonical order)."""
        return [p for p in self.pieces if self.process_of(p) == process]

    def process_range(self, bucket: Bucket, process: int) -> tuple:
        """The elements of ``bucket`` whose state ``process`` holds."""
        per_process = bucket.length // self.processes
        return process * per_process, (process + 1) * per_process

    @property
    def sharded(self) -> bool:
        """True when some state is split over more than one replica."""
        return bool(self.pieces) and self.processes * self.replicas_per_process > 1


def balanced_ranges(numel: int, parts: int) -> list[tuple]:
    """``parts`` contiguous ranges covering ``range(numel)``, sizes differing by at most
    one (the first ``numel % parts`` one longer), as ``torch.tensor_split``."""
    base, extra = divmod(numel, parts)
    ranges, start = [], 0
    for k in range(parts):
        end = start + base + (1 if k < extra else 0)
        ranges.append((start, end))
        start = end
    return ranges


def plan_layout(params: Sequence[torch.Tensor], *, min_elements: int,
                replicas_per_process: int, processes: int, elementwise: bool,
                slot_members: dict[int, list[list[int]]] | None = None) -> ShardLayout:
    """The layout of ``params`` (see module docstring).

    ``slot_members[i]``: for a replica-grouped parameter ``i`` (first dimension one
    slice per group, or per replica), the global replicas sharing each slice; other
    parameters are shared by every replica.
    """
    total = replicas_per_process * processes
    slot_members = slot_members or {}
    pieces: list[Piece] = []
    replicated: list[int] = []
    flat: list[int] = []
    load = [0] * total
    for i, p in enumerate(params):
        if (p.numel() < max(min_elements, 1) or not p.is_contiguous() or total == 1
                or not p.requires_grad):
            replicated.append(i)
            continue
        if not elementwise:
            owner = min(range(total), key=lambda k: (load[k], k))
            load[owner] += p.numel()
            pieces.append(Piece(i, 0, p.numel(), owner, whole=True))
            continue
        slots = slot_members.get(i)
        if slots is None:
            flat.append(i)
            continue
        slot_size = p.numel() // len(slots)
        for s, members in enumerate(slots):
            base = s * slot_size
            for (start, end), owner in zip(balanced_ranges(slot_size, len(members)),
                                           members, strict=False):
                if end > start:
                    pieces.append(Piece(i, base + start, base + end, owner))
    buckets = _buckets(params, flat, total)
    for b, bucket in enumerate(buckets):
        per_replica = bucket.length // total
        for i, offset in zip(bucket.params, bucket.offsets, strict=False):
            end_of_param = offset + params[i].numel()
            for k in range(total):
                start = max(offset, k * per_replica)
                end = min(end_of_param, (k + 1) * per_replica)
                if end > start:
                    pieces.append(Piece(i, start - offset, end - offset, k, bucket=b))
    # Canonical order: by process, then parameter, then position (the gather's order).
    pieces.sort(key=lambda q: (q.owner // replicas_per_process, q.param, q.start))
    return ShardLayout(pieces, replicated, replicas_per_process, processes, buckets)


def _buckets(params: Sequence[torch.Tensor], indices: list[int], replicas: int
             ) -> list[Bucket]:
    """Consecutive ``indices`` of one dtype and device in buckets of about
    ``BUCKET_ELEMENTS`` (a larger tensor alone), padded to a multiple of ``replicas``."""
    groups: list[list[int]] = []
    for i in indices:
        last = groups[-1] if groups else None
        if last is not None:
            head = params[last[0]]
            size = sum(params[j].numel() for j in last)
            if (params[i].dtype == head.dtype and params[i].device == head.device
                    and size + params[i].numel() <= BUCKET_ELEMENTS):
                last.append(i)
                continue
        groups.append([i])
    buckets = []
    for group in groups:
        offsets, length = [], 0
        for i in group:
            offsets.append(length)
            length += params[i].numel()
        length = -(-length // replicas) * replicas
        buckets.append(Bucket(tuple(group), tuple(offsets), length))
    return buckets
