"""Local replicas that run at the same time, one per device.

With ``replicationFactor(r)`` in one process, replica ``k`` plays IPU ``k``. When those
IPUs are different GPUs, the replicas run concurrently, as ``r`` IPUs would: replica
``k`` holds its own copy of the model on its GPU and runs its micro-batches
(``n % r == k``) in its own thread. Replica 0 is the model itself; the optimizer updates
it alone, and the other copies take its weights before each step. After the backward
passes each copy's gradients are added to replica 0's, so the optimizer sees the sum
over all micro-batches of the step, as with replicas run one after another (the order of
the additions differs, so results agree to rounding). Every copy keeps its own buffers;
with ``broadcastBuffers`` replica 0's are sent to the others after each step.

On the CPU the same runner, forced with ``POPTORCH_CONCURRENT_REPLICAS=1``, runs the
replicas in threads on CPU copies: the CPU stands in for several GPUs to test it.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import types
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from .. import context
from ..attributes import own_attribute
from ..batching.plan import Microbatch
from ..torch_internals import foreach_copy_, pytree
from .overlapped_io import FirstForwardCheck
from .runner import LossOf


def _moved(tree: Any, device: torch.device) -> Any:
    """``tree``'s tensors on ``device``, detached (inputs arrive detached; outputs are
    only read)."""
    return pytree.tree_map(
        lambda t: t.detach().to(device, non_blocking=True)
        if isinstance(t, torch.Tensor) else t, tree)


def _rebind(value: Any, memo: dict) -> Any:
    """``value`` (part of an instance-level ``forward``) pointed at the copies in
    ``memo``: bound methods and modules of the original model become the copy's,
    closures are rebuilt around rebound cells, anything else is shared."""
    if isinstance(value, types.MethodType) and id(value.__self__) in memo:
        return types.MethodType(value.__func__, memo[id(value.__self__)])
    if isinstance(value, torch.nn.Module):
        return memo.get(id(value), value)
    if isinstance(value, types.FunctionType) and value.__closure__:
        cells = tuple(types.CellType(_rebind(c.cell_contents, memo))
                      for c in value.__closure__)
        rebuilt = types.FunctionType(value.__code__, value.__globals__, value.__name__,
                                     value.__defaults__, cells)
        rebuilt.__kwdefaults__ = value.__kwdefaults__
        functools.update_wrapper(rebuilt, value, assigned=(), updated=("__dict__",))
        return rebuilt
    return value


def copy_model(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """A deep copy of ``model`` on ``device`` whose wrapped forwards (autocast, precision
    adaptations: instance-level ``forward`` closures over the original modules) call the
    copy, not the original."""
    memo: dict = {}
    replica = copy.deepcopy(model, memo)
    for original, copied in zip(model.modules(), replica.modules(), strict=False):
        forward = own_attribute(original, "forward")
        if forward is not None:
            copied.forward = _rebind(forward, memo)
    return replica.to(device)


class ConcurrentReplicas:
    """StepRunner running local replica ``k`` on ``devices[k]`` in its own thread (see
    module docstring). ``devices[0]`` is where ``model`` lives."""

    def __init__(self, model: torch.nn.Module, devices: list[torch.device],
                 broadcast_buffers: bool, per_step: int,
                 check: FirstForwardCheck | None = None) -> None:
        self.model = model
        # PopTorch's rules of the overlap markers, checked on replica 0's first forward
        self.check = check
        self.per_step = per_step
        self.devices = devices
        self.broadcast_each_step = broadcast_buffers
        self.replicas: list[torch.nn.Module] = []
        self.params: list[list[torch.nn.Parameter]] = []
        self.buffers: list[list[torch.Tensor]] = []
        # Thread-local contexts of the program (autocast, function modes), entered in
        # every worker thread; set by the device program.
        self.worker_contexts: list = []
        self.pool = ThreadPoolExecutor(max_workers=len(devices) - 1,
                                       thread_name_prefix="poptorch-replica")

    def _make_copies(self) -> None:
        """Copy the model once per other device, at the first call: by then the
        executor has finished preparing it (precision, autocast wrappers)."""
        self.replicas = [self.model] + [copy_model(self.model, d) for d in self.devices[1:]]
        self.params = [list(m.parameters()) for m in self.replicas]
        self.buffers = [list(m.buffers()) for m in self.replicas]

    def __call__(self, microbatches: list[Microbatch],
                 loss_of: LossOf | None) -> list[Any]:
        if not self.replicas:
            self._make_copies()
        self._send_weights()
        if not (self.broadcast_each_step and self.buffers[0]):
            return self._run_step(microbatches, loss_of)
        # Replica 0's buffers reach the others after every step (inference iteration).
        outputs = []
        for start in range(0, len(microbatches), self.per_step):
            outputs.extend(self._run_step(microbatches[start:start + self.per_step],
                                          loss_of))
            self.broadcast()
        return outputs

    def _run_step(self, microbatches: list[Microbatch],
                  loss_of: LossOf | None) -> list[Any]:
        r = len(self.replicas)
        training = loss_of is not None
        shares = [microbatches[k::r] for k in range(r)]
        futures = [self.pool.submit(self._worker, k, shares[k], loss_of)
                   for k in range(1, r)]
        errors = []
        try:
            first = self._run(0, shares[0], loss_of)
        except BaseException as exc:  # pylint: disable=broad-except
            errors.append(exc)
        results = []
        for future in futures:
            try:
                results.append(future.result())
            except BaseException as exc:  # pylint: disable=broad-except
                errors.append(exc)
        if errors:
            self._drop_replica_grads()
            raise errors[0]
        per_replica = [first, *results]
        if training:
            self._gather_grads()
        outputs: list[Any] = [None] * len(microbatches)
        for k, outs in enumerate(per_replica):
            for i, out in enumerate(outs):
                outputs[k + i * r] = out
        return outputs

    def _worker(self, k: int, share: list[Microbatch], loss_of: LossOf | None) -> list:
        with context.worker_scope(self.worker_contexts), context.running_on_ipu(), \
                torch.set_grad_enabled(loss_of is not None), self._device_scope(k):
            return self._run(k, share, loss_of)

    def _device_scope(self, k: int) -> Any:
        device = self.devices[k]
        if device.type == "cuda":
            return torch.cuda.device(device)
        return contextlib.nullcontext()

    def _run(self, k: int, share: list[Microbatch], loss_of: LossOf | None) -> list:
        model, device, home = self.replicas[k], self.devices[k], self.devices[0]
        outputs = []
        r, per_step = len(self.replicas), self.per_step
        for i, (args, kwargs) in enumerate(share):
            if k:
                args, kwargs = _moved((args, kwargs), device)
            # Named as the sequential runners name their micro-batches in traces.
            with torch.profiler.record_function(
                    f"poptorch::micro-batch {(k + i * r) % per_step} replica {k}"):
                check = self.check if k == 0 else None
                if check is None:
                    out = model(*args, **kwargs)
                else:
                    out = check.run(model, args, kwargs)
                    self.check = None
            if loss_of is not None:
                loss_of(out).backward()
            outputs.append(_moved(out, home) if k else out)
        return outputs

    def _send_weights(self) -> None:
        """Give every copy replica 0's current weights (updated by the optimizer or
        written by the host since the last step)."""
        with torch.no_grad():
            for params in self.params[1:]:
                foreach_copy_(list[torch.Tensor](params), list[torch.Tensor](self.params[0]),
                                     non_blocking=True)

    def _gather_grads(self) -> None:
        """Add every copy's gradients to replica 0's and clear them."""
        with torch.no_grad():
            for params in self.params[1:]:
                for master, param in zip(self.params[0], params, strict=False):
                    grad = param.grad
                    if grad is None:
                        continue
                    grad = grad.to(master.device, non_blocking=True)
                    if master.grad is None:
                        master.grad = grad
                    else:
                        master.grad.add_(grad)
                    param.grad = None

    def _drop_replica_grads(self) -> None:
        for params in self.params[1:]:
            for param in params:
                param.grad = None

    def broadcast(self) -> None:
        """Copy replica 0's buffers to every other replica (also after the host wrote
        them)."""
        if not self.replicas:
            return
        with torch.no_grad():
            for buffers in self.buffers[1:]:
                foreach_copy_(buffers, self.buffers[0], non_blocking=True)
