"""What a user reads off a compiled model after a call: compilation time, performance
counters and latencies, cycle count, tensor names and anchored tensors. A base class of
:py:class:`~poptorch.PoplarExecutor`, kept apart so that the executor module stays about
running the model."""
from __future__ import annotations

import datetime
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from .._runtime.compilation import Compilation
from ..errors import Error, PoptorchAssertionError

if TYPE_CHECKING:
    from ..options.options import Options


class ExecutorInspection:
    """Read-only views of the last call (see module docstring)."""

    # provided by PoplarExecutor
    _require_compilation: Callable[[str], Compilation]
    _options: Options
    _model: torch.nn.Module
    _training: bool

    # ------------------------------------------------------------------ timings
    def compilationTime(self) -> datetime.timedelta:
        """How long compilation took."""
        compiled = self._require_compilation("compilationTime")
        return datetime.timedelta(seconds=compiled.compile_seconds)

    def getPerfCounters(self) -> dict:
        """Host timestamps of the last call: {'input', 'input_complete', 'output',
        'output_complete'} -> [per input / output tensor][per transfer] seconds (one
        transfer per micro-batch; outputs only those the output mode returns)."""
        compiled = self._require_compilation("getPerfCounters")
        program = compiled.program
        num_inputs, num_outputs = compiled.calls.io_counts
        spec = program.spec
        plan = spec.plan
        return program.perf.shaped(num_inputs, num_outputs, plan.per_step,
                                   plan.replication_factor, spec.output_mode,
                                   spec.output_return_period)

    def getHostIpuLatency(self) -> tuple[float, float, float]:
        """(min, max, mean) seconds from input requested to input transferred."""
        return self._require_compilation("getHostIpuLatency").program.perf.latencies(
            "input", "input_complete")

    def getComputeLatency(self) -> tuple[float, float, float]:
        """(min, max, mean) seconds from input transferred to output available."""
        return self._require_compilation("getComputeLatency").program.perf.latencies(
            "input_complete", "output")

    def getIpuHostLatency(self) -> tuple[float, float, float]:
        """(min, max, mean) seconds from output available to output on the host."""
        return self._require_compilation("getIpuHostLatency").program.perf.latencies(
            "output", "output_complete")

    def getLatency(self) -> tuple[float, float, float]:
        """(min, max, mean) round-trip seconds of the iterations of the last call."""
        return self._require_compilation("getLatency").program.perf.latencies(
            "input", "output_complete")

    def cycleCount(self) -> int:
        """Device time of the last call, in nanoseconds (our devices have no cycle
        counter: one "cycle" is one nanosecond). Needs ``Options.logCycleCount(True)``."""
        program = self._require_compilation("cycleCount").program
        if not self._options.exists("log_cycle_count") or not self._options.log_cycle_count:
            raise Error("cycleCount: enable it before compiling with "
                        "opts.logCycleCount(True).")
        return int(program.stats.last_compute_seconds * 1e9)

    # ------------------------------------------------------------------ tensors
    def getTensorNames(self) -> list[str]:
        """Names of the tensors that can be anchored: parameters, their gradients
        (``Gradient___<name>``, training only) and buffers."""
        self._require_compilation("getTensorNames")
        from .._runtime.batching.anchors import tensor_names
        return tensor_names(self._model, self._training)

    def getAnchoredTensor(self, short_name: str) -> torch.Tensor:
        """The value of an anchored tensor (``Options.anchorTensor``) after the last call."""
        anchors = self._require_compilation("getAnchoredTensor").anchors
        if not anchors:
            raise PoptorchAssertionError(
                f"getAnchoredTensor: no tensor is anchored as '{short_name}'; anchor it "
                "with opts.anchorTensor(short_name, long_name) before compiling.")
        return anchors.get(short_name)

