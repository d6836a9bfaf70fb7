"""Phased execution's streaming memory (the phased schedules are in
``_runtime/schedule/schedules.py``).

All micro-batches go through a phase before the next one starts, so a phase's weights
are loaded once per step. *Streaming memory* is host memory. A phase's weights are
streamed (on their IPU's device only while their phase runs, in host memory, where the
optimizer updates them, otherwise) when the strategy's :py:class:`~poptorch.Liveness`
is not ``AlwaysLive`` or ``opts.TensorLocations`` puts weights off chip (``onChip:
False``, at least ``minElementsForOffChip`` elements). Activations saved for the
backward pass wait in host memory when the liveness is not ``AlwaysLive`` or
activations are put off chip.
"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Mapping

import torch

from ...enums import Liveness
from ..config import PlacementConfig
from .partition import Partition

HOST = torch.device("cpu")


def _location_off_chip(settings: object, numel: int) -> bool:
    # (the frozen configuration holds the settings as a read-only mapping)
    if not isinstance(settings, Mapping) or settings.get("onChip", True):
        return False
    return numel >= int(settings.get("minElementsForOffChip", 0))


class StreamingMemory:
    """Moves each phase's weights between host memory and the phase's devices, and
    accounts for what is resident (``resident_bytes``, ``peak_resident_bytes``): the
    ``LOAD`` / ``STORE`` actions of the phased schedules (:py:meth:`load`,
    :py:meth:`store`; thread-safe: parallel phases run two lanes at once)."""

    def __init__(self, model: torch.nn.Module, partition: Partition,
                 devices: list[torch.device], config: PlacementConfig) -> None:
        strategy = partition.strategy
        self.liveness: Liveness = strategy.tensors_liveness
        weight_loc = config.weight_locations
        act_loc = config.activation_locations
        self.stream_activations = (self.liveness != Liveness.AlwaysLive
                                   or _location_off_chip(act_loc, 1))
        self._device_of: dict[int, torch.device] = {}
        self._phase_weights: dict[int, list[torch.Tensor]] = {}
        self._pinned: list[torch.Tensor] = []
        weights = list(model.parameters()) + list(model.buffers())
        for t in weights:
            stage = partition.weight_stage.get(id(t))
            if stage is None:
                continue
            plan = partition.stages[stage]
            self._device_of[id(t)] = devices[plan.ipu]
            streamed = (self.liveness != Liveness.AlwaysLive
                        or _location_off_chip(weight_loc, t.numel()))
            if streamed:
                self._phase_weights.setdefault(plan.phase or 0, []).append(t)
            else:
                self._pinned.append(t)
        self.resident: dict[int, bool] = dict.fromkeys(self._phase_weights, False)
        self.resident_bytes = 0
        self.peak_resident_bytes = 0
        self.loads: list[int] = []  # phases loaded, in order
        self._lock = threading.Lock()
        for t in self._pinned:
            self._move(t, self._device_of[id(t)])
        self.resident_bytes = sum(t.nbytes for t in self._pinned)
        self.peak_resident_bytes = self.resident_bytes
        for phase in self._phase_weights:
            self._offload_phase(phase, count=False)

    def load(self, phase: int) -> None:
        """``phase``'s streamed weights to their devices (if not there already)."""
        with self._lock:
            if phase not in self.resident or self.resident[phase]:
                return
            for t in self._phase_weights[phase]:
                self._move(t, self._device_of[id(t)])
            self.resident[phase] = True
            self.resident_bytes += sum(t.nbytes for t in self._phase_weights[phase])
            self.peak_resident_bytes = max(self.peak_resident_bytes, self.resident_bytes)
            self.loads.append(phase)

    def store(self, phase: int) -> None:
        """``phase``'s streamed weights (and gradients) back to host memory."""
        with self._lock:
            self._offload_phase(phase)

    def enter(self, phase: int, lane_previous: int | None) -> None:
        """A lane starts running ``phase`` after ``lane_previous`` (a model that was
        not captured: its forward reaches the phases as it runs)."""
        if lane_previous is not None and lane_previous != phase:
            self.store(lane_previous)
        self.load(phase)

    def offload_all(self) -> None:
        """End of a step: streamed weights (and their gradients) go back to the host,
        where the optimizer updates them."""
        for phase in list(self.resident):
            self.store(phase)

    def _offload_phase(self, phase: int | None, count: bool = True) -> None:
        if phase not in self.resident or (count and not self.resident[phase]):
            return
        for t in self._phase_weights[phase]:
            self._move(t, HOST)
        if count:
            self.resident_bytes -= sum(t.nbytes for t in self._phase_weights[phase])
        self.resident[phase] = False

    @staticmethod
    def _move(t: torch.Tensor, device: torch.device) -> None:
        if t.device != device:
            t.data = t.data.to(device)
            if t.grad is not None:
                t.grad = t.grad.to(device)

    def activation_scope(self, devices: list[torch.device]
                         ) -> contextlib.AbstractContextManager[None]:
        """Saved activations go to host memory between forward and backward."""
        if self.stream_activations and any(d.type != "cpu" for d in devices):
            return torch.autograd.graph.save_on_cpu(pin_memory=False)
        return contextlib.nullcontext()
