"""``horovod.torch``'s API over ``torch.distributed`` (OpenPopTorch).

Graphcore's applications import ``horovod.torch`` beside PopDist and, under PopRun,
call ``hvd.init()``, ``allreduce``, ``broadcast``, ``broadcast_parameters``,
``allgather``, ``grouped_allreduce`` and ``local_rank()`` for metrics, seeds and
checkpoints. Horovod 0.28 does not build against current PyTorch (its C++ is compiled
as C++14; PyTorch's headers need C++17), so these functions are provided here with the
same names, arguments and results, each one a ``torch.distributed`` collective on the
default process group (the one ``poprun`` / ``torchrun`` programs and PopTorch models
share: gloo for CPU tensors, NCCL for CUDA tensors). There is no communication layer of
our own, no background thread, no tensor fusion and no ``DistributedOptimizer``
(PopTorch models reduce their gradients themselves).
"""
from __future__ import annotations

import atexit
import os
from typing import Any, Iterable

import torch
import torch.distributed as dist

__all__ = [
    "Adasum", "Average", "Compression", "Max", "Min", "Product", "Sum", "allgather",
    "allgather_object", "allreduce", "allreduce_", "barrier", "broadcast", "broadcast_",
    "broadcast_object", "broadcast_optimizer_state", "broadcast_parameters",
    "cross_rank", "cross_size", "grouped_allreduce", "grouped_allreduce_", "init",
    "is_initialized", "local_rank", "local_size", "rank", "shutdown", "size",
]


class HorovodError(RuntimeError):
    """A call this stand-in cannot serve (or made before ``init()``)."""


# Reduction ops (Horovod's names).
Average, Sum, Adasum, Min, Max, Product = ("Average", "Sum", "Adasum", "Min", "Max",
                                           "Product")
_DIST_OPS = {Sum: dist.ReduceOp.SUM, Average: dist.ReduceOp.SUM, Min: dist.ReduceOp.MIN,
             Max: dist.ReduceOp.MAX, Product: dist.ReduceOp.PRODUCT}


class _NoneCompressor:
    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor


class _FP16Compressor:
    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        if tensor.is_floating_point():
            return tensor.to(torch.float16), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor if ctx is None else tensor.to(ctx)


class Compression:
    """Compression of tensors on the wire: ``none`` or ``fp16``."""
    none = _NoneCompressor
    fp16 = _FP16Compressor


_created_here = False
_initialised = False


def _env(name: str, default: int) -> int:
    value = os.environ.get(name)
    return int(value) if value not in (None, "") else default


def init(comm: Any = None, process_sets: Any = None) -> None:
    """Join the program's ``torch.distributed`` process group (created here from
    torchrun's ``RANK`` / ``WORLD_SIZE`` / ``MASTER_ADDR`` when nobody made it yet)."""
    global _created_here, _initialised
    if comm is not None or process_sets not in (None, []):
        raise HorovodError("horovod.torch.init: comm and process_sets are not supported "
                           "by OpenPopTorch's horovod.torch (one global process set).")
    world = _env("WORLD_SIZE", 1)
    if world > 1 and not dist.is_initialized():
        try:  # the same group, and the same clean exit, as PopTorch models use
            from poptorch._runtime.distributed.world import join
            join(_env("RANK", 0), world, torch.device("cpu"))
        except ImportError:
            backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
            dist.init_process_group(backend, rank=_env("RANK", 0), world_size=world)
            _created_here = True
    _initialised = True


@atexit.register
def _leave() -> None:
    if _created_here and dist.is_initialized():
        dist.destroy_process_group()


def shutdown() -> None:
    """Forget :func:`init` (the process group stays for PopTorch's models)."""
    global _initialised
    _initialised = False


def is_initialized() -> bool:
    return _initialised


def _check(what: str) -> bool:
    """True when there are other processes to talk to."""
    if not _initialised:
        raise HorovodError(f"horovod.torch.{what}: call hvd.init() first.")
    return dist.is_initialized() and dist.get_world_size() > 1


def size() -> int:
    """Number of processes."""
    _check("size")
    return dist.get_world_size() if dist.is_initialized() else 1


def rank() -> int:
    """This process's rank."""
    _check("rank")
    return dist.get_rank() if dist.is_initialized() else 0


def local_rank() -> int:
    """This process's rank on its host (torchrun's ``LOCAL_RANK``)."""
    _check("local_rank")
    return _env("LOCAL_RANK", 0)


def local_size() -> int:
    """Processes on this host (torchrun's ``LOCAL_WORLD_SIZE``)."""
    _check("local_size")
    return _env("LOCAL_WORLD_SIZE", size())


def cross_rank() -> int:
    """This host's index (torchrun's ``GROUP_RANK``)."""
    _check("cross_rank")
    return _env("GROUP_RANK", 0)


def cross_size() -> int:
    """Number of hosts."""
    return max(1, size() // max(1, local_size()))


def _op(average: bool | None, op: str | None) -> str:
    if average is not None and op is not None:
        raise HorovodError("horovod.torch: give either average= (deprecated) or op=, not "
                           "both.")
    if op is None:
        op = Sum if average is False else Average
    if op == Adasum:
        raise HorovodError("horovod.torch: op=Adasum is not supported by OpenPopTorch's "
                           "horovod.torch; use Average or Sum.")
    if op not in _DIST_OPS:
        raise HorovodError(f"horovod.torch: unknown op {op!r}; use hvd.Average, hvd.Sum, "
                           "hvd.Min, hvd.Max or hvd.Product.")
    return op


def _reduce_in_place(tensor: torch.Tensor, op: str, compression: Any,
                     prescale: float, postscale: float) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise HorovodError(f"horovod.torch.allreduce: expected a tensor, got "
                           f"{type(tensor).__name__}.")
    distributed = _check("allreduce")
    wire, ctx = compression.compress(tensor * prescale if prescale != 1.0 else tensor)
    wire = wire.contiguous()
    if distributed:
        dist.all_reduce(wire, op=_DIST_OPS[op])
    result = compression.decompress(wire, ctx)
    divisor = size() if op == Average else 1
    if result.is_floating_point():
        if postscale != 1.0 or divisor != 1:
            result = result * (postscale / divisor)
    elif postscale != 1.0 or divisor != 1:  # integers: truncated, as integer division
        result = torch.div(result * postscale, divisor, rounding_mode="trunc")
    if result is not tensor:
        tensor.copy_(result)
    return tensor


def allreduce_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
               op: str | None = None, prescale_factor: float = 1.0,
               postscale_factor: float = 1.0, process_set: Any = None,
               compression: Any = Compression.none) -> torch.Tensor:
    """Reduce ``tensor`` over all processes, in place (default: the average)."""
    return _reduce_in_place(tensor, _op(average, op), compression, prescale_factor,
                            postscale_factor)


def allreduce(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
              compression: Any = Compression.none, op: str | None = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: Any = None) -> torch.Tensor:
    """The reduction of ``tensor`` over all processes (a new tensor; default: the
    average)."""
    return _reduce_in_place(tensor.detach().clone(), _op(average, op), compression,
                            prescale_factor, postscale_factor)


def grouped_allreduce(tensors: Iterable[torch.Tensor], average: bool | None = None,
                      name: str | None = None, compression: Any = Compression.none,
                      op: str | None = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0,
                      process_set: Any = None) -> list[torch.Tensor]:
    """:func:`allreduce` of each tensor of a list."""
    return [allreduce(t, average, None, compression, op, prescale_factor,
                      postscale_factor) for t in tensors]


def grouped_allreduce_(tensors: Iterable[torch.Tensor], average: bool | None = None,
                       name: str | None = None, op: str | None = None,
                       prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                       process_set: Any = None) -> list[torch.Tensor]:
    """:func:`allreduce_` of each tensor of a list."""
    return [allreduce_(t, average, None, op, prescale_factor, postscale_factor)
            for t in tensors]


def allgather(tensor: torch.Tensor, name: str | None = None,
              process_set: Any = None) -> torch.Tensor:
    """The processes' tensors concatenated along the first dimension, in rank order
    (their first dimensions may differ; the others must agree)."""
    if not _check("allgather"):
        return tensor.detach().clone() if tensor.dim() else tensor.detach().reshape(1)
    tensor = tensor.detach()
    if tensor.dim() == 0:
        tensor = tensor.reshape(1)
    rows = torch.tensor([tensor.shape[0]], device=tensor.device)
    all_rows = [torch.zeros_like(rows) for _ in range(size())]
    dist.all_gather(all_rows, rows)
    longest = int(max(r.item() for r in all_rows))
    padded = torch.zeros((longest, *tensor.shape[1:]), dtype=tensor.dtype,
                         device=tensor.device)
    padded[:tensor.shape[0]] = tensor
    parts = [torch.empty_like(padded) for _ in range(size())]
    dist.all_gather(parts, padded.contiguous())
    return torch.cat([p[:int(r.item())] for p, r in zip(parts, all_rows)])


def allgather_object(obj: Any, name: str | None = None) -> list:
    """Every process's ``obj``, in rank order."""
    if not _check("allgather_object"):
        return [obj]
    out = [None] * size()
    dist.all_gather_object(out, obj)
    return out


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
               process_set: Any = None) -> torch.Tensor:
    """Overwrite ``tensor`` with process ``root_rank``'s, in place."""
    if _check("broadcast"):
        _check_root(root_rank)
        if tensor.is_contiguous():
            dist.broadcast(tensor, src=root_rank)
        else:
            buffer = tensor.contiguous()
            dist.broadcast(buffer, src=root_rank)
            tensor.copy_(buffer)
    return tensor


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None,
              process_set: Any = None) -> torch.Tensor:
    """Process ``root_rank``'s ``tensor`` (a new tensor)."""
    return broadcast_(tensor.detach().clone(), root_rank)


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None,
                     process_set: Any = None) -> Any:
    """Process ``root_rank``'s ``obj`` (pickled)."""
    if not _check("broadcast_object"):
        return obj
    _check_root(root_rank)
    box = [obj]
    dist.broadcast_object_list(box, src=root_rank)
    return box[0]


def _check_root(root_rank: int) -> None:
    if not 0 <= root_rank < size():
        raise HorovodError(f"horovod.torch: root_rank {root_rank} is not a rank "
                           f"(0 .. {size() - 1}).")


def broadcast_parameters(params: Any, root_rank: int) -> None:
    """Overwrite, in place, each tensor of ``params`` (a ``state_dict()``, or
    ``named_parameters()``) with process ``root_rank``'s."""
    items = sorted(params.items()) if isinstance(params, dict) else list(params)
    for entry in items:
        if not (isinstance(entry, tuple) and len(entry) == 2):
            raise HorovodError("horovod.torch.broadcast_parameters: expected a dict or a "
                               "list of (name, tensor) pairs, such as "
                               "model.state_dict() or model.named_parameters().")
        value = entry[1]
        if isinstance(value, torch.Tensor):
            with torch.no_grad():
                broadcast_(value.data if isinstance(value, torch.nn.Parameter) else value,
                           root_rank)


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int) -> None:
    """Give every process process ``root_rank``'s optimizer state and hyper-parameters."""
    if not _check("broadcast_optimizer_state"):
        return
    state = broadcast_object(optimizer.state_dict() if rank() == root_rank else None,
                             root_rank)
    if rank() != root_rank:
        optimizer.load_state_dict(state)


def barrier(process_set: Any = None) -> None:
    """Wait for every process."""
    if _check("barrier"):
        dist.barrier()


def __getattr__(name: str) -> Any:
    raise AttributeError(
        f"horovod.torch.{name} is not provided by OpenPopTorch's horovod.torch, which "
        f"covers the calls PopTorch programs make ({', '.join(__all__)}), over "
        "torch.distributed. PopTorch models reduce gradients themselves "
        "(no DistributedOptimizer needed).")
