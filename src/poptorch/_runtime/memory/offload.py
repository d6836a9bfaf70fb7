"""Off-chip storage (``TensorLocationSettings().useOnChipStorage(False)``): tensors kept in
host memory and moved to their device while they are used.

* Optimizer state: :py:class:`StateStorage` keeps the state tensors of parameters with
  at least ``minElementsForOffChip`` elements in host memory (pinned, so that the copies
  are asynchronous) and the step (``sharding.ManagedStep``) fetches them to the
  parameter's device one chunk of parameters at a time, runs the update there and writes
  them back: the device holds one chunk's state at a time, as PopTorch's streaming memory
  loads a tensor into the chip only when it is used.
* Activations: :py:class:`ActivationsOffChip` runs the forward passes under
  ``torch.autograd.graph.save_on_cpu(pin_memory=True)``: tensors saved for the backward
  pass wait in host memory.

On the CPU, host memory *is* the device's memory: nothing moves (``StateStorage.stream``
is False) and the option is logged once at INFO. ``force_stream`` makes the CPU copy
anyway, to test the logic of the moves on the CPU.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch

from ..._typing import StateDict

HOST = torch.device("cpu")


class StateStorage:
    """Where optimizer state tensors live between steps (see module docstring)."""

    def __init__(self, off_chip: bool, min_elements: int = 0,
                 force_stream: bool = False) -> None:
        self.off_chip = off_chip
        self.min_elements = min_elements
        self.force_stream = force_stream
        self.pin = torch.cuda.is_available()

    def streams(self, param: torch.Tensor) -> bool:
        """Whether the state of ``param`` (a parameter or a piece of one) lives in host
        memory and moves to ``param``'s device for each update."""
        if not self.off_chip or param.numel() < self.min_elements:
            return False
        return param.device.type != "cpu" or self.force_stream

    def fetch(self, state: StateDict, device: torch.device) -> StateDict:
        """The state tensors of one parameter on ``device`` (copies; asynchronous from
        pinned memory)."""
        return {k: v.to(device, non_blocking=True, copy=True)
                if isinstance(v, torch.Tensor) and v.dim() > 0 else v
                for k, v in state.items()}

    def store(self, host: StateDict, used: StateDict) -> None:
        """Write the state ``used`` by an update back into ``host`` (allocating pinned
        host tensors for entries the update created)."""
        for key, value in used.items():
            if not isinstance(value, torch.Tensor) or value.dim() == 0:
                host[key] = value
                continue
            old = host.get(key)
            if (not isinstance(old, torch.Tensor) or old.shape != value.shape
                    or old.dtype != value.dtype or old.device != HOST):
                old = torch.empty(value.shape, dtype=value.dtype, device=HOST,
                                  pin_memory=self.pin)
                host[key] = old
            old.copy_(value, non_blocking=True)

    @staticmethod
    def wait(devices: Iterable[torch.device]) -> None:
        """Wait for the asynchronous copies to ``devices``' host memory."""
        for device in {d for d in devices if d.type == "cuda"}:
            torch.cuda.current_stream(device).synchronize()


def chunks(params: list[torch.Tensor], max_elements: int) -> list[list[torch.Tensor]]:
    """``params`` in consecutive chunks of at most ``max_elements`` elements (a larger
    tensor is a chunk of its own)."""
    result: list[list[torch.Tensor]] = []
    current: list[torch.Tensor] = []
    size = 0
    for p in params:
        if current and size + p.numel() > max_elements:
            result.append(current)
            current, size = [], 0
        current.append(p)
        size += p.numel()
    if current:
        result.append(current)
    return result


class ActivationsOffChip:
    """Entered around every call: tensors saved for the backward pass go to pinned host
    memory and come back when the backward pass uses them. ``thread_context`` gives
    worker threads (pipelines, concurrent replicas) the same, as saved-tensor hooks are
    per thread."""

    def __init__(self) -> None:
        self._active: list[torch.autograd.graph.save_on_cpu] = []

    @staticmethod
    def thread_context() -> torch.autograd.graph.save_on_cpu:
        return torch.autograd.graph.save_on_cpu(pin_memory=True)

    def __enter__(self) -> None:
        hooks = self.thread_context()
        hooks.__enter__()
        self._active.append(hooks)

    def __exit__(self, *exc: object) -> None:
        self._active.pop().__exit__(*exc)
