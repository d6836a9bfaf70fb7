"""PopVision's trace instrumentation API (``import libpvti as pvti``) for OpenPopTorch:
channels, tracepoints, instant events, graphs and heatmaps written into the run's
Perfetto / Chrome trace, the same file as PopTorch's own profiling
(``poptorch.<pid>.trace.json``, see docs/profiling.md).

* ``PVTI_OPTIONS='{"enable":"true","directory":"reports"}'`` turns recording on, as
  upstream (the trace starts at the first use of this module and is written when the
  process exits); a profiled model (``Options.enableProfiling`` /
  ``POPLAR_ENGINE_OPTIONS``) records them too. Otherwise every call returns at once.
* A tracepoint is a range named ``"<channel>::<label>"`` (a
  ``torch.profiler.record_function``), nested like the code; ``Tracepoint.event`` is an
  instant event; each graph series is a counter track named ``"<graph> [<unit>]"`` with
  one value per series; a heatmap is a counter track with one count per bucket.
"""
from __future__ import annotations

import bisect
import functools
import itertools
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

from poptorch._runtime import tracing
from poptorch.errors import Error

__all__ = ["Channel", "Graph", "HeatmapDouble", "HeatmapUInt64", "Series", "Tracepoint",
           "createTraceChannel", "isEnabled"]

_pvti_directory: str | None = None
_checked = False
_lock = threading.Lock()


def _session() -> Any:
    """The run's profiler when recording is on, else None (the no-op path)."""
    session = tracing._SESSION  # read directly: this is every call's no-op path
    if session is not None or (_checked and _pvti_directory is None):
        return session
    return _start_from_environment()


def _start_from_environment() -> Any:
    global _checked, _pvti_directory
    with _lock:
        if not _checked:
            _pvti_directory = tracing.env_profile_directory()
            _checked = True
    if _pvti_directory is None:
        return None
    return tracing.session(_pvti_directory)


def isEnabled() -> bool:
    """True when tracepoints, events and series are being recorded."""
    return _session() is not None


def _check_name(what: str, name: Any) -> str:
    if not isinstance(name, str) or not name:
        raise Error(f"libpvti.{what}: the name must be a non-empty string, got {name!r}.")
    return name


class Channel:
    """A named group of tracepoints (``createTraceChannel``)."""

    def __init__(self, name: str) -> None:
        self.name = _check_name("createTraceChannel", name)

    def __repr__(self) -> str:
        return f"libpvti.Channel({self.name!r})"


def createTraceChannel(name: str) -> Channel:
    """A trace channel: its tracepoints are named ``"<name>::<label>"`` in the trace."""
    return Channel(name)


def _check_channel(what: str, channel: Any) -> Channel:
    if not isinstance(channel, Channel):
        raise Error(f"libpvti.{what}: expected a channel from libpvti.createTraceChannel, "
                    f"got {channel!r}.")
    return channel


_open = threading.local()


class Tracepoint:
    """A timed range on a channel: ``with pvti.Tracepoint(channel, "label"):``, or as a
    decorator, ``@pvti.Tracepoint(channel, "label")``."""

    def __init__(self, channel: Channel, label: str) -> None:
        self.channel = _check_channel("Tracepoint", channel)
        self.label = _check_name("Tracepoint", label)
        self._local = threading.local()  # open ranges per thread (a shared decorator)

    def __enter__(self) -> Tracepoint:
        scope = None
        if _session() is not None:
            scope = torch.profiler.record_function(f"{self.channel.name}::{self.label}")
            scope.__enter__()
        ranges = getattr(self._local, "ranges", None)
        if ranges is None:
            ranges = self._local.ranges = []
        ranges.append(scope)
        return self

    def __exit__(self, *exc: Any) -> None:
        scope = self._local.ranges.pop()
        if scope is not None:
            scope.__exit__(*exc)

    def __call__(self, function: Callable) -> Callable:
        @functools.wraps(function)
        def traced(*args: Any, **kwargs: Any) -> Any:
            with self:
                return function(*args, **kwargs)
        return traced

    @staticmethod
    def begin(channel: Channel, label: str) -> None:
        """Open a range (closed by :meth:`end` with the same channel and label)."""
        point = Tracepoint(channel, label)
        point.__enter__()
        stack = getattr(_open, "points", None)
        if stack is None:
            stack = _open.points = []
        stack.append(point)

    @staticmethod
    def end(channel: Channel, label: str) -> None:
        """Close the range :meth:`begin` opened last on this thread."""
        stack = getattr(_open, "points", [])
        if not stack or stack[-1].channel is not channel or stack[-1].label != label:
            open_one = f"{stack[-1].channel.name}::{stack[-1].label}" if stack else "none"
            raise Error(f"libpvti.Tracepoint.end({channel.name!r}, {label!r}): the "
                        f"innermost open tracepoint is {open_one}; end them in the "
                        "reverse order of begin.")
        stack.pop().__exit__(None, None, None)

    @staticmethod
    def event(channel: Channel, name: str) -> None:
        """An instant event ``"<channel>::<name>"`` at this moment."""
        if type(channel) is not Channel or type(name) is not str or not name:
            _check_channel("Tracepoint.event", channel)
            _check_name("Tracepoint.event", name)
        session = _session()
        if session is not None:
            session.add_events([{"ph": "i", "s": "p", "cat": "pvti",
                                 "name": f"{channel.name}::{name}",
                                 "tid": threading.get_ident(),
                                 "ts_ns": time.perf_counter_ns()}])


def _number(what: str, value: Any) -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise Error(f"libpvti.{what}: expected one number, got a tensor of shape "
                        f"{tuple(value.shape)}.")
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise Error(f"libpvti.{what}: expected a number, got {value!r}.")
    return float(value)


class Series:
    """One line of a :class:`Graph`: ``series.add(value)`` records a value now."""

    def __init__(self, graph: Graph, name: str) -> None:
        self.graph = graph
        self.name = _check_name("Graph.addSeries", name)

    def add(self, value: Any) -> None:
        """Record ``value`` (a number or a one-element tensor) at this moment."""
        if type(value) is not float and type(value) is not int:  # checked even when off
            value = _number("Series.add", value)
        session = _session()
        if session is not None:
            session.add_events([{"ph": "C", "cat": "pvti", "name": self.graph.track,
                                 "ts_ns": time.perf_counter_ns(),
                                 "args": {self.name: float(value)}}])


class Graph:
    """A graph of numbers over time (a counter track, ``"<name> [<unit>]"``)."""

    def __init__(self, name: str, unit: str = "") -> None:
        self.name = _check_name("Graph", name)
        if not isinstance(unit, str):
            raise Error(f"libpvti.Graph: unit must be a string, got {unit!r}.")
        self.unit = unit
        self.track = f"{name} [{unit}]" if unit else name
        self.series: list[Series] = []

    def addSeries(self, name: str) -> Series:
        """A new series (line) of this graph."""
        series = Series(self, name)
        self.series.append(series)
        return series


class _Heatmap:
    """Counts of values per bucket over time: a counter track with one value per
    bucket ``"[lo, hi)"`` (below the first edge and from the last edge on too)."""

    _kind: type = float

    def __init__(self, name: str, edges: Iterable[Any], unit: str = "") -> None:
        self.name = _check_name(type(self).__name__, name)
        self.edges = [self._kind(e) for e in edges]
        if not self.edges or any(a >= b for a, b in zip(self.edges, self.edges[1:], strict=False)):
            raise Error(f"libpvti.{type(self).__name__}: bucket edges must be a non-empty, "
                        f"strictly increasing list, got {self.edges!r}.")
        self.unit = unit
        self.track = f"{name} [{unit}]" if unit else name
        bounds = ["-inf"] + [str(e) for e in self.edges] + ["inf"]
        self.buckets = [f"[{lo}, {hi})" for lo, hi in itertools.pairwise(bounds)]

    def _convert(self, value: Any) -> Any:
        return self._kind(value)

    def add(self, values: Iterable[Any]) -> None:
        """Record a batch of values (a list or tensor): one count per bucket, now."""
        session = _session()
        if session is None:
            return
        if isinstance(values, torch.Tensor):
            values = values.flatten().tolist()
        counts = [0] * len(self.buckets)
        for value in values:
            counts[bisect.bisect_right(self.edges, self._convert(value))] += 1
        session.add_events([{"ph": "C", "cat": "pvti", "name": self.track,
                             "ts_ns": time.perf_counter_ns(),
                             "args": dict(zip(self.buckets, counts, strict=False))}])


class HeatmapDouble(_Heatmap):
    """A heatmap of floating-point values."""
    _kind = float


class HeatmapUInt64(_Heatmap):
    """A heatmap of unsigned integer values."""
    _kind = int

    def _convert(self, value: Any) -> int:
        if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()) \
                or int(value) < 0:
            raise Error(f"libpvti.HeatmapUInt64.add: values must be non-negative integers, "
                        f"got {value!r}.")
        return int(value)
