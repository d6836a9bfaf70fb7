"""Performance counters of the last call (``PoplarExecutor.getPerfCounters`` and the
latency getters).

The device loop records four host timestamps per device iteration. Users see them in
PopTorch's shape: one list per input tensor and one per output tensor, each holding one
timestamp per micro-batch transfer. Inputs are transferred for every micro-batch of
every replica (``d * g * r`` entries); outputs only for what the output mode returns:

* ``All``: ``d * g * r``; ``Final`` and ``Sum``: ``r``;
* ``EveryN``: ``(d / N) * g * r`` (the iterations whose index + 1 is a multiple of N).

With synthetic data nothing moves between host and device: every list is empty and
every latency is ``(0.0, 0.0, 0.0)``.
"""
from __future__ import annotations

from ...enums import OutputMode
from ...errors import Error

KEYS = ("input", "input_complete", "output", "output_complete")


class PerfCounters:
    """Host timestamps (seconds) of the last call, one entry per device iteration."""

    def __init__(self) -> None:
        self.counters: dict[str, list[float]] = {key: [] for key in KEYS}
        self.synthetic = False  # set by the executor when inputs never leave the device
        self._lists = tuple(self.counters[key] for key in KEYS)  # the same list objects

    def record_single(self, t_start: float, t_end: float) -> None:
        """The counters of a call of one device iteration that took inputs at
        ``t_start`` and gave outputs at ``t_end`` (the lists are updated in place)."""
        inputs, inputs_complete, outputs, outputs_complete = self._lists
        if len(inputs) != 1 or len(outputs_complete) != 1:
            for stamps in self._lists:
                stamps[:] = (0.0,)
        inputs[0] = inputs_complete[0] = t_start
        outputs[0] = outputs_complete[0] = t_end

    def latencies(self, start: str, end: str) -> tuple[float, float, float]:
        """(min, max, mean) of ``end - start`` over the iterations of the last call."""
        if self.synthetic:
            return 0.0, 0.0, 0.0
        spans = [b - a for a, b in zip(self.counters[start], self.counters[end], strict=False)]
        if not spans:
            raise Error("No performance counters yet: run the model first.")
        return min(spans), max(spans), sum(spans) / len(spans)

    def shaped(self, num_inputs: int, num_outputs: int, per_step: int, replicas: int,
               mode: OutputMode, period: int) -> dict[str, list[list[float]]]:
        """The counters in PopTorch's shape (see module docstring)."""
        if self.synthetic:
            return {"input": [[] for _ in range(num_inputs)],
                    "input_complete": [[] for _ in range(num_inputs)],
                    "output": [[] for _ in range(num_outputs)],
                    "output_complete": [[] for _ in range(num_outputs)]}
        iterations = len(self.counters["input"])
        if mode in (OutputMode.Final, OutputMode.Sum):
            returned, copies = [iterations - 1] if iterations else [], replicas
        elif mode == OutputMode.EveryN:
            returned = [i for i in range(iterations) if (i + 1) % period == 0]
            copies = per_step
        else:
            returned, copies = list(range(iterations)), per_step

        def expand(key: str, which: list[int], n: int) -> list[float]:
            stamps = self.counters[key]
            return [stamps[i] for i in which for _ in range(n)]

        every = list(range(iterations))
        shaped = {}
        for key in ("input", "input_complete"):
            row = expand(key, every, per_step)
            shaped[key] = [list(row) for _ in range(num_inputs)]
        for key in ("output", "output_complete"):
            row = expand(key, returned, copies)
            shaped[key] = [list(row) for _ in range(num_outputs)]
        return shaped
