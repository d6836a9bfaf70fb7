"""poptorch.profiling.Channel: tracepoints in torch.profiler traces and in the channel."""
import json
import time

import pytest
import torch

import poptorch
import poptorch.profiling


def test_tracepoint_records_timing_and_profiler_range(tmp_path):
    channel = poptorch.profiling.Channel("MyApp")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        before = time.perf_counter_ns()
        with channel.tracepoint("TimeThis"):
            time.sleep(0.01)
        after = time.perf_counter_ns()
    record = channel.records[-1]
    assert record.name == "TimeThis"
    assert before <= record.start_ns and record.start_ns + record.duration_ns <= after
    assert record.duration_ns >= 10_000_000
    assert "MyApp::TimeThis" in {event.key for event in prof.key_averages()}
    trace = tmp_path / "trace.json"
    prof.export_chrome_trace(str(trace))
    names = {event.get("name") for event in json.loads(trace.read_text())["traceEvents"]}
    assert "MyApp::TimeThis" in names


def test_tracepoint_records_even_when_the_block_raises():
    channel = poptorch.profiling.Channel("App")
    with pytest.raises(ValueError):
        with channel.tracepoint("failing"):
            raise ValueError("boom")
    assert [r.name for r in channel.records] == ["failing"]


def test_instrument_wraps_methods_and_keeps_results():
    class Worker:
        def step(self, x):
            return x + 1

        def other(self):
            return "done"

    worker = Worker()
    channel = poptorch.profiling.Channel("Work")
    channel.instrument(worker, "step", "other")
    assert worker.step(2) == Worker().step(2)
    assert worker.other() == "done"
    assert [r.name for r in channel.records] == ["step", "other"]
    with pytest.raises(poptorch.Error, match="no method 'missing'"):
        channel.instrument(worker, "missing")
    with pytest.raises(poptorch.Error, match="non-empty"):
        poptorch.profiling.Channel("")
