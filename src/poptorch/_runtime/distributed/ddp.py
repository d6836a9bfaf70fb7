"""DDP's reducer for the one-stage interpreter: the gradients of a step are reduced over
the processes while the backward pass of the step's last micro-batch still runs.

``DistributedDataParallel`` wraps the device model; every micro-batch of a step but the
last runs under ``no_sync()``. DDP's C++ reduction averages over the processes (no
Python per bucket); the device program turns that into PopTorch's Mean / Sum. DDP
neither broadcasts at construction nor syncs buffers (``replicas`` does).

DDP is attached after the first step, which the post-backward reducer runs and which
records which parameters the last micro-batch's backward reached on every process. If
all of them, DDP runs without ``find_unused_parameters`` (no graph search nor extra
all-reduce per step), and a later step that leaves a parameter without gradient raises
:py:class:`poptorch.Error` before the update rather than apply unreduced gradients.
Otherwise, or with ``POPTORCH_DISTRIBUTED_FIND_UNUSED=1``, DDP searches every step.
"""
import contextlib
import inspect
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from ..._devices import env_setting
from ...errors import Error
from ..program.interpreter import EagerCompute
from .collectives import failures_as_errors

FIND_UNUSED_ENV = "POPTORCH_DISTRIBUTED_FIND_UNUSED"


def _no_buffer_sync() -> dict[str, Any]:
    """DDP's keyword that turns off its per-forward buffer broadcast: newer torch renamed
    ``broadcast_buffers`` to ``forward_sync_buffers`` and warns on the old name (init-time
    syncing is off either way: ``init_sync=False`` gates every construction collective)."""
    params = inspect.signature(torch.nn.parallel.DistributedDataParallel).parameters
    if "forward_sync_buffers" in params:
        return {"forward_sync_buffers": False}
    return {"broadcast_buffers": False}


_NO_BUFFER_SYNC = _no_buffer_sync()


class DdpSync:
    """The ``ALL_REDUCE`` of the one-stage interpreter's schedule (``GradientSync``):
    once DDP is attached, the micro-batch after an ``ALL_REDUCE`` action (the last of
    each step) runs through DDP with its reduction, the others under ``no_sync()``.
    Before that, the last micro-batch records which parameters its backward pass
    reached (``last_used``), for the choice of ``find_unused_parameters``."""

    def __init__(self, compute: EagerCompute, params: list[torch.nn.Parameter]) -> None:
        self.compute = compute  # its forward becomes DDP's once attached
        self.params = params
        self.ddp: torch.nn.parallel.DistributedDataParallel | None = None
        self.check_used = False
        # Before DDP: per parameter, whether the last micro-batch's backward reached it.
        self.last_used: list[bool] | None = None

    def attach(self, model: torch.nn.Module, group: dist.ProcessGroup | None,
               device: torch.device, all_used: bool) -> None:
        """Run ``model`` through DDP from the next step on (built on every process at the
        same point: construction checks the parameter shapes collectively); ``all_used``:
        every process's last backward pass reached every parameter."""
        find_unused = not all_used or bool(env_setting(FIND_UNUSED_ENV))
        self.ddp = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device] if device.type == "cuda" else None,
            process_group=group, init_sync=False, find_unused_parameters=find_unused,
            **_NO_BUFFER_SYNC)
        self.compute.forward_fn = self.ddp
        self.check_used = not find_unused

    def forward_scope(self, reduce: bool) -> contextlib.AbstractContextManager[object]:
        ddp = self.ddp
        return ddp.no_sync() if ddp is not None and not reduce else contextlib.nullcontext()

    @contextlib.contextmanager
    def backward_scope(self, reduce: bool) -> Iterator[None]:
        ddp = self.ddp
        if not reduce:
            with ddp.no_sync() if ddp is not None else contextlib.nullcontext():
                yield
            return
        if ddp is None:
            with self._probe():
                yield
            return
        with failures_as_errors("Summing gradients (DDP)", runs_model=True), \
                self._probe() if self.check_used else contextlib.nullcontext():
            yield
        if self.check_used and not all(self.last_used or ()):
            raise Error(
                "A trainable parameter got no gradient in the last micro-batch of this step "
                "on this process, although every parameter got one in the first step: DDP "
                "(without its search for unused parameters) did not reduce its gradients "
                "across the processes, so the step was not applied (the other processes stop "
                "with a timeout error). For models that leave parameters unused in some "
                f"steps, set {FIND_UNUSED_ENV}=1 on every process.")

    @contextlib.contextmanager
    def _probe(self) -> Iterator[None]:
        """Record which parameters the backward pass reached (a gradient that appeared,
        was replaced or was added to in place)."""
        before = [(p.grad, p.grad._version if p.grad is not None else -1)
                  for p in self.params]
        yield
        self.last_used = [p.grad is not None and (p.grad is not grad or
                                                  p.grad._version != version)
                          for p, (grad, version) in zip(self.params, before, strict=False)]
