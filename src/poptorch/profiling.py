"""Profiling channels: named tracepoints in your own code (``poptorch.profiling``).

Upstream wrote tracepoints to PopVision's libpvti. Here each tracepoint is a
``torch.profiler.record_function`` range named ``"<channel>::<tracepoint>"``, so it
appears in ``torch.profiler`` traces (``prof.key_averages()``, or the Chrome/Perfetto
trace written by ``prof.export_chrome_trace(path)``), and the channel also keeps its own
timing record (:py:attr:`Channel.records`), available without running a profiler.
"""
from __future__ import annotations

import collections
import contextlib
import functools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from ._typing import UserInput, UserOutput
from .errors import Error

__all__ = ["Channel", "TraceRecord"]


@dataclass(frozen=True)
class TraceRecord:
    """One completed tracepoint: its name, start (``time.perf_counter_ns``) and duration."""
    name: str
    start_ns: int
    duration_ns: int


class Channel:
    """A named profiling channel.

    >>> channel = poptorch.profiling.Channel("MyApp")
    >>> with channel.tracepoint("TimeThis"):
    ...     functionToTime()
    >>> channel.instrument(myobj, "methodName", "otherMethod")

    ``records`` holds the latest ``max_records`` completed tracepoints (oldest first).
    """

    max_records = 100_000

    def __init__(self, name: str) -> None:
        if not isinstance(name, str) or not name:
            raise Error(f"Channel: name must be a non-empty string, got {name!r}.")
        self.name = name
        self.records: collections.deque[TraceRecord] = collections.deque(
            maxlen=self.max_records)

    @contextlib.contextmanager
    def tracepoint(self, name: str) -> Iterator[None]:
        """Time the code inside the ``with`` block as tracepoint ``name``."""
        start = time.perf_counter_ns()
        try:
            with torch.profiler.record_function(f"{self.name}::{name}"):
                yield
        finally:
            self.records.append(TraceRecord(name, start, time.perf_counter_ns() - start))

    def instrument(self, obj: object, *methods: str) -> None:
        """Wrap each named method of ``obj`` in a tracepoint named after the method."""
        if not methods:
            raise Error("Channel.instrument: name at least one method to instrument.")
        for method in methods:
            original = getattr(obj, method, None)
            if not callable(original):
                raise Error(f"Channel.instrument: {type(obj).__name__} has no method "
                            f"{method!r}.")
            setattr(obj, method, self._traced(original, method))

    def _traced(self, function: Callable[..., UserOutput], name: str
                ) -> Callable[..., UserOutput]:
        @functools.wraps(function)
        def traced(*args: UserInput, **kwargs: UserInput) -> UserOutput:
            with self.tracepoint(name):
                return function(*args, **kwargs)
        return traced
