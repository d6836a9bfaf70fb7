"""Profiling: one Chrome / Perfetto trace per run and a summary of where the time went.

Turned on by ``Options.enableProfiling(dir)``, or the variables PopTorch users set for
PopVision: ``POPLAR_ENGINE_OPTIONS`` (``autoReport.all`` / ``autoReport.directory``) or
``PVTI_OPTIONS`` (``enable`` / ``directory``); the directory defaults to the current one.

The first profiled model starts one :py:mod:`torch.profiler` session for the whole
process; it ends at exit (or :py:func:`finish`), writing
``<dir>/poptorch.<pid>.trace.json`` and printing a summary. Besides torch's operator
events the trace holds ranges per call, device iteration and micro-batch forward (on the
calling thread; torch's profiler does not follow worker threads), and one row per
pipeline stage added from the schedule's timestamps when the trace is written
(docs/profiling.md lists them).
"""
from __future__ import annotations

import atexit
import contextlib
import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from .._logging import info_once, logger
from .environment import ENGINE_OPTIONS, PVTI_OPTIONS, json_options
from .schedule.timeline import ScheduleRecord

_TRUE = ("true", "1", "yes", "on")


def profile_directory(config: Any) -> str | None:
    """Where this model's run is profiled, or None (module docstring)."""
    if config.profile_dir is not None:  # (a RuntimeConfig)
        return config.profile_dir
    return env_profile_directory()


def env_profile_directory() -> str | None:
    """Where ``POPLAR_ENGINE_OPTIONS`` / ``PVTI_OPTIONS`` ask the run to be profiled, or
    None when they do not."""
    engine = json_options(ENGINE_OPTIONS)
    if str(engine.get("autoReport.all", "")).lower() in _TRUE:
        return str(engine.get("autoReport.directory", "."))
    pvti = json_options(PVTI_OPTIONS)
    if str(pvti.get("enable", "")).lower() in _TRUE:
        return str(pvti.get("directory", engine.get("autoReport.directory", ".")))
    return None


@dataclass
class ModelStats:
    """Host timings of one profiled model, summed over the run."""
    name: str
    calls: int = 0
    call_seconds: float = 0.0
    compute_seconds: float = 0.0
    waiting_seconds: float = 0.0
    iterations: int = 0
    microbatches: int = 0
    forward_seconds: float = 0.0
    stage_busy: dict = field(default_factory=dict)
    stage_span: float = 0.0
    bubble: list = field(default_factory=list)


class RunProfiler:
    """The process's profiling session (module docstring). Use :py:func:`session`."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.models: list[ModelStats] = []
        self.stage_events: list[dict] = []
        self.extra_events: list[dict] = []
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.profile = torch.profiler.profile(activities=activities)
        self.profile.__enter__()
        # A range with a known host time, to place the stage events on torch's clock
        # (the clock range's midpoint is taken as the midpoint of the perf_counter reads
        # around it; the first range pays the profiler's first-use cost, ~0.1-1 ms).
        with torch.profiler.record_function("poptorch::run"):
            pass
        before = time.perf_counter_ns()
        with torch.profiler.record_function("poptorch::clock"):
            pass
        self.clock_ns = (before + time.perf_counter_ns()) // 2
        self.path: str | None = None
        self.summary: str | None = None

    def add_stage_events(self, name: str, record: ScheduleRecord,
                         stats: ModelStats) -> None:
        """Record the ops of one pipeline / sharded / phased step (``ScheduleRecord``)."""
        events = record.events
        if not events:
            return
        for e in events:
            kind = "forward" if e.kind == "F" else "backward"
            self.stage_events.append({
                "name": f"stage {e.stage} {kind} {e.microbatch}", "stage": e.stage,
                "model": name, "start": e.start, "end": e.end})
            stats.stage_busy[e.stage] = stats.stage_busy.get(e.stage, 0.0) + e.end - e.start
        stats.stage_span += max(e.end for e in events) - min(e.start for e in events)
        stats.bubble.append(record.bubble_fraction())

    def add_events(self, events: list[dict]) -> None:
        """Chrome trace events to write with the trace, each with ``"ts_ns"`` (a
        ``time.perf_counter_ns()`` time, placed on torch's clock when written) and no
        ``pid`` (this process's)."""
        self.extra_events.extend(events)

    def finish(self) -> str:
        """Stop profiling, write the trace and return its path (idempotent)."""
        if self.path is not None:
            return self.path
        self.profile.__exit__(None, None, None)
        os.makedirs(self.directory, exist_ok=True)
        path = os.path.join(self.directory, f"poptorch.{os.getpid()}.trace.json")
        self.profile.export_chrome_trace(path)
        self._add_stage_rows(path)
        self.path = path
        self.summary = render_summary(self.models, path)
        return path

    def _add_stage_rows(self, path: str) -> None:
        if not self.stage_events and not self.extra_events:
            return
        with open(path, encoding="utf-8") as f:
            trace = json.load(f)
        events = trace.setdefault("traceEvents", [])
        marker = next((e for e in events if e.get("name") == "poptorch::clock"), None)
        if marker is None:
            return
        offset_us = float(marker["ts"]) + float(marker.get("dur", 0)) / 2 - \
            self.clock_ns / 1000.0
        pid = marker.get("pid", os.getpid())
        for stage in sorted({e["stage"] for e in self.stage_events}):
            events.append({"ph": "M", "name": "thread_name", "pid": pid,
                           "tid": f"poptorch stage {stage}",
                           "args": {"name": f"poptorch stage {stage}"}})
        for e in self.stage_events:
            events.append({"ph": "X", "cat": "poptorch", "name": e["name"], "pid": pid,
                           "tid": f"poptorch stage {e['stage']}",
                           "ts": e["start"] * 1e6 + offset_us,
                           "dur": (e["end"] - e["start"]) * 1e6,
                           "args": {"model": e["model"]}})
        for e in self.extra_events:
            event = {k: v for k, v in e.items() if k != "ts_ns"}
            event.update(pid=pid, ts=e["ts_ns"] / 1000.0 + offset_us)
            events.append(event)
        with open(path, "w", encoding="utf-8") as f:
            json.dump(trace, f)


_SESSION: RunProfiler | None = None
_LOCK = threading.Lock()


def session(directory: str) -> RunProfiler:
    """The run's profiler, started on first use (the first directory asked wins)."""
    global _SESSION
    with _LOCK:
        if _SESSION is None:
            _SESSION = RunProfiler(directory)
            atexit.register(_at_exit)
            info_once(("profile", directory),
                      "Profiling this run: the trace is written to %s when the process "
                      "exits", os.path.join(directory, f"poptorch.{os.getpid()}.trace.json"))
        elif os.path.abspath(directory) != os.path.abspath(_SESSION.directory):
            info_once(("profile-dir", directory),
                      "Profiling: one trace per run, already written to %s (not %s)",
                      _SESSION.directory, directory)
        return _SESSION


def finish() -> str | None:
    """End the run's profiling now: write the trace, print the summary, return the
    trace's path (None when nothing was profiled). A later profiled call starts a new
    trace."""
    global _SESSION
    with _LOCK:
        current, _SESSION = _SESSION, None
    if current is None:
        return None
    path = current.finish()
    print(current.summary, flush=True)
    return path


def _at_exit() -> None:
    try:
        finish()
    except Exception as e:  # never turn a finished run into a crash at exit
        logger.warning("Profiling: could not write the trace: %s", e)


class CallProfiler:
    """Profiles every call of one model: :py:meth:`call` is entered around the whole
    call (with the host's input splitting and output collection), the object itself
    around the device loop (the compute part)."""

    def __init__(self, directory: str, name: str, trace: StepTrace) -> None:
        self.directory = directory
        self.name = name
        self.trace = trace
        self.stats: ModelStats | None = None
        self._session: RunProfiler | None = None
        self._last_end: float | None = None

    @contextlib.contextmanager
    def call(self) -> Iterator[None]:
        """One call of the model: its range and its share of the summary."""
        stats = self._begin()
        t0 = time.perf_counter()
        with torch.profiler.record_function(f"poptorch::{self.name} call {stats.calls}"):
            try:
                yield
            finally:
                end = time.perf_counter()
                stats.calls += 1
                stats.call_seconds += end - t0
                if self._last_end is not None:
                    stats.waiting_seconds += max(0.0, t0 - self._last_end)
                self._last_end = end

    def _begin(self) -> ModelStats:
        session_ = session(self.directory)
        stats = self.stats
        if session_ is not self._session or stats is None:
            self._session = session_
            self.stats = stats = ModelStats(self.name)
            session_.models.append(stats)
            self._last_end = None
        self.trace.begin_call(stats, session_, self.name)
        return stats

    def __enter__(self) -> None:
        self._t0 = time.perf_counter()

    def __exit__(self, *exc: Any) -> None:
        if self.stats is not None:  # (entered inside a profiled run: always set)
            self.stats.compute_seconds += time.perf_counter() - self._t0


class StepTrace:
    """What the profiler records of a model's steps (no runner of its own: the device
    program enters :py:meth:`iteration` around each runner call, the one-stage
    interpreter :py:meth:`forward` around each forward action): one range per device
    iteration, one per micro-batch forward naming its replica, and the stage events of
    the schedule a model-parallel step executed (``executed()``, when given)."""

    def __init__(self, per_step: int, replicas: int,
                 executed: Callable[[], ScheduleRecord | None] | None = None) -> None:
        self.per_step = per_step
        self.replicas = replicas
        self.executed = executed
        self.stats: ModelStats | None = None
        self.session: RunProfiler | None = None
        self.name = ""
        self._iteration = 0

    def begin_call(self, stats: ModelStats, session_: RunProfiler, name: str) -> None:
        self.stats, self.session, self.name = stats, session_, name
        self._iteration = 0

    @contextlib.contextmanager
    def iteration(self, microbatches: int) -> Iterator[None]:
        """Around one runner call of ``microbatches`` micro-batches."""
        first = self._iteration
        count = max(1, microbatches // self.per_step)
        self._iteration += count
        label = f"device iteration {first}" if count == 1 else \
            f"device iterations {first}-{first + count - 1}"
        with torch.profiler.record_function(f"poptorch::{label}"):
            yield
        if self.stats is not None:
            self.stats.iterations += count
            record = None if self.executed is None else self.executed()
            if record is not None and self.session is not None:
                self.session.add_stage_events(self.name, record, self.stats)

    @contextlib.contextmanager
    def forward(self, microbatch: int, replica: int) -> Iterator[None]:
        """Around the forward action of one micro-batch."""
        t0 = time.perf_counter()
        with torch.profiler.record_function(
                f"poptorch::micro-batch {microbatch} replica {replica}"):
            yield
        if self.stats is not None:
            self.stats.forward_seconds += time.perf_counter() - t0
            self.stats.microbatches += 1


def render_summary(models: list[ModelStats], path: str) -> str:
    """The text printed when the run's trace is written."""
    lines = [f"[poptorch] Profile of this run: {path} (open in ui.perfetto.dev)"]
    for s in models:
        if s.calls == 0:
            continue
        host = max(0.0, s.call_seconds - s.compute_seconds)
        lines.append(f"  {s.name}: {s.calls} calls, {s.iterations} device iterations, "
                     f"{s.call_seconds:.4f} s in calls = {s.compute_seconds:.4f} s compute "
                     f"(device loop) + {host:.4f} s host (inputs, outputs); "
                     f"{s.waiting_seconds:.4f} s waiting for the host between calls "
                     "(data loading, user code)")
        if s.microbatches:
            rest = max(0.0, s.compute_seconds - s.forward_seconds)
            lines.append(f"    forward passes: {s.forward_seconds:.4f} s over "
                         f"{s.microbatches} micro-batches; backward, optimizer and host "
                         f"work inside calls: {rest:.4f} s")
        if s.stage_busy:
            span = s.stage_span or 1e-12
            per_stage = ", ".join(f"stage {k}: {v:.4f} s ({100 * v / span:.0f}% busy)"
                                  for k, v in sorted(s.stage_busy.items()))
            idle = 1.0 - sum(s.stage_busy.values()) / (span * len(s.stage_busy))
            schedule = sum(s.bubble) / len(s.bubble)
            lines.append(f"    time per stage: {per_stage}")
            lines.append(f"    pipeline bubble: {schedule:.3f} of the schedule's slots "
                         f"idle, {max(0.0, idle):.3f} of stage time idle as measured")
    return "\n".join(lines)
