"""libpvti with tracing off: the cost of a tracepoint, an instant event and a series
value in a loop, against the same loop without them (issue 24: "no-op cost when tracing
is off"), and against ``torch.profiler.record_function`` (what a user of plain PyTorch
would write to mark a range), which records nothing without a profiler either.

Run: ``python benchmarks/bench_libpvti.py`` (PVTI_OPTIONS and POPLAR_ENGINE_OPTIONS
unset). Prints nanoseconds per iteration and the ratios.
"""
from __future__ import annotations

import os
import statistics
import time

import torch

os.environ.pop("PVTI_OPTIONS", None)
os.environ.pop("POPLAR_ENGINE_OPTIONS", None)
import libpvti as pvti  # noqa: E402

N = 200_000


def timed(body) -> float:
    rounds = []
    for _ in range(5):
        t0 = time.perf_counter_ns()
        body()
        rounds.append((time.perf_counter_ns() - t0) / N)
    return statistics.median(rounds)


def bare() -> None:
    total = 0.0
    for i in range(N):
        total += i


channel = pvti.createTraceChannel("bench")
series = pvti.Graph("g").addSeries("s")
point = pvti.Tracepoint(channel, "step")


def with_pvti() -> None:
    total = 0.0
    for i in range(N):
        with point:
            total += i
        series.add(total)
        pvti.Tracepoint.event(channel, "e")


def with_record_function() -> None:
    total = 0.0
    for i in range(N):
        with torch.profiler.record_function("step"):
            total += i


def main() -> None:
    assert not pvti.isEnabled()
    base, pv, rf = timed(bare), timed(with_pvti), timed(with_record_function)
    print(f"bare loop:                      {base:8.1f} ns/iter")
    print(f"libpvti off (range+value+event): {pv:8.1f} ns/iter  "
          f"(+{pv - base:.1f} ns; {pv / base:.1f}x the bare loop)")
    print(f"torch record_function (no prof): {rf:8.1f} ns/iter  "
          f"(+{rf - base:.1f} ns)")
    print(f"libpvti off / record_function overhead: {(pv - base) / (rf - base):.2f}")


if __name__ == "__main__":
    main()
