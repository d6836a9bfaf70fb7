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

The one-stage interpreter runs these lanes (``Interpreter.run_lanes_on``): its schedule
of a step, each lane's ``F`` / ``B`` actions on that lane's copy and thread, then the
``ALL_REDUCE`` of the lanes' gradients into replica 0's and the ``BROADCAST`` of its
buffers. On the CPU the same lanes, forced with ``POPTORCH_CONCURRENT_REPLICAS=1``, run
in threads on CPU copies: the CPU stands in for several GPUs to test it.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import types
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar, cast

import torch

from ..._typing import UserOutput
from .. import context
from ..attributes import own_attribute
from ..batching.plan import Microbatch
from ..torch_internals import foreach_copy_, pytree

Tree = TypeVar("Tree")
Result = TypeVar("Result")


def _moved(tree: Tree, device: torch.device) -> Tree:
    """``tree``'s tensors on ``device``, detached (inputs arrive detached; outputs are
    only read)."""
    return pytree.tree_map_only(
        torch.Tensor, lambda t: t.detach().to(device, non_blocking=True), tree)


def _rebind(value: object, memo: dict[int, object]) -> object:
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
            copied.forward = cast(Callable[..., object], _rebind(forward, memo))
    return replica.to(device)


class ReplicaCopies:
    """The lanes of local replica ``k`` on ``devices[k]``, each with a copy of the model
    and a thread of its own (see module docstring); the interpreter
    (``interpreter.Interpreter.run_lanes_on``) runs each lane's actions of a step on
    them. ``devices[0]`` is where ``model`` lives: lane 0 runs in the calling thread."""

    def __init__(self, model: torch.nn.Module, devices: list[torch.device],
                 broadcast_buffers: bool) -> None:
        self.model = model
        self.devices = devices
        # replica 0's buffers to the others after each step (a model without buffers
        # has nothing to send)
        self.broadcast_each_step = broadcast_buffers and next(model.buffers(), None) is not None
        self.replicas: list[torch.nn.Module] = []
        self.params: list[list[torch.nn.Parameter]] = []
        self.buffers: list[list[torch.Tensor]] = []
        # Thread-local contexts of the program (autocast, function modes), entered in
        # every worker thread; set once at compile time.
        self.worker_contexts: list[context.ContextFactory] = []
        self.pool = ThreadPoolExecutor(max_workers=len(devices) - 1,
                                       thread_name_prefix="poptorch-replica")

    def prepare(self) -> None:
        """Copy the model once per other device, at the first call (by then the
        executor has finished preparing it: precision, autocast wrappers), and give
        every copy replica 0's current weights (updated by the optimizer or written by
        the host since the last step)."""
        if not self.replicas:
            self.replicas = [self.model] + [copy_model(self.model, d)
                                            for d in self.devices[1:]]
            self.params = [list(m.parameters()) for m in self.replicas]
            self.buffers = [list(m.buffers()) for m in self.replicas]
        with torch.no_grad():
            for params in self.params[1:]:
                foreach_copy_(list[torch.Tensor](params), list[torch.Tensor](self.params[0]),
                              non_blocking=True)

    def run(self, lane: Callable[[int], Result]) -> list[Result]:
        """``lane(k)`` for every replica ``k`` at once (``k > 0`` in its worker thread,
        on its device); each lane's outputs, or the first error once all are done (the
        other copies' gradients then dropped)."""
        training = context.is_running_training()  # (the caller's: a training run)
        futures = [self.pool.submit(self._worker, lane, k, training)
                   for k in range(1, len(self.replicas))]
        errors: list[BaseException] = []
        results: list[Result] = []
        try:
            results.append(lane(0))
        except BaseException as exc:  # pylint: disable=broad-except
            errors.append(exc)
        for future in futures:
            try:
                results.append(future.result())
            except BaseException as exc:  # pylint: disable=broad-except
                errors.append(exc)
        if errors:
            self._drop_replica_grads()
            raise errors[0]
        return results

    def _worker(self, lane: Callable[[int], Result], k: int, training: bool) -> Result:
        device = self.devices[k]
        with context.worker_scope(self.worker_contexts), context.running_on_ipu(training), \
                (torch.cuda.device(device) if device.type == "cuda"
                 else contextlib.nullcontext()):
            return lane(k)

    def moved_in(self, k: int, microbatch: Microbatch) -> Microbatch:
        """A micro-batch's inputs on lane ``k``'s device."""
        return microbatch if k == 0 else _moved(microbatch, self.devices[k])

    def moved_home(self, k: int, output: UserOutput) -> UserOutput:
        """A lane's output on replica 0's device."""
        return output if k == 0 else _moved(output, self.devices[0])

    def gather_grads(self) -> None:
        """The step's ``ALL_REDUCE`` between the lanes: every copy's gradients added to
        replica 0's, and cleared."""
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
        if not self.replicas or not self.buffers[0]:
            return
        with torch.no_grad():
            for buffers in self.buffers[1:]:
                foreach_copy_(buffers, self.buffers[0], non_blocking=True)
