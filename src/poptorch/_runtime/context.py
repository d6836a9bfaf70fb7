"""Process-wide execution state shared by the executor and the ops.

* whether a model is running "on the IPU" right now (``poptorch.isRunningOnIpu``);
* the tensors that ``poptorch.identity_loss`` marked as the loss of the current forward;
* the checker of ``set_overlap_for_input`` / ``set_overlap_for_output`` markers while a
  model is captured as a graph or its first forward runs (``program/overlapped_io.py``).
"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch

from .._typing import UserInput, UserOutput
from ..enums import OverlapMode


class OverlapChecker(Protocol):
    """What the overlap markers report to while a model is captured or its first
    forward runs: each returns what the marker returns in place of ``structure``."""

    def mark_input(self, structure: UserInput, mode: OverlapMode) -> UserInput: ...

    def mark_output(self, structure: UserOutput, mode: OverlapMode) -> UserOutput: ...


class _ThreadState(threading.local):
    """Initialised in every thread that reads it (``threading.local`` calls
    ``__init__`` per thread), so hot paths read plain attributes."""

    def __init__(self) -> None:
        self.depth = 0      # executor calls running in this thread
        self.training = 0   # those of them that run a training model
        self.losses: list = []  # losses marked by identity_loss in the current forward
        # the marker checker of a capture or a first forward, if one runs
        self.overlap: OverlapChecker | None = None


_state = _ThreadState()
STATE = _state
"""The per-thread state itself, for a caller's hot path: ``depth`` counts the executor
calls running in this thread, ``training`` those of a training model, ``losses`` is the
list of marked losses."""


def is_running_on_ipu() -> bool:
    """True only while an executor runs the wrapped model."""
    return _state.depth > 0


def is_running_training() -> bool:
    """True only while an executor runs the wrapped model of a ``trainingModel`` (in
    the thread that runs its forward and backward passes)."""
    return _state.training > 0


class running_on_ipu:
    """Context manager marking the model as running on the IPU (re-entrant, per thread);
    ``training``: the model is a training model's."""

    def __init__(self, training: bool = False) -> None:
        self._training = 1 if training else 0

    def __enter__(self) -> running_on_ipu:
        _state.depth += 1
        _state.training += self._training
        return self

    def __exit__(self, *exc: object) -> None:
        _state.depth -= 1
        _state.training -= self._training


ContextFactory = Callable[[], AbstractContextManager[Any]]
"""Makes a context manager a worker thread enters (its return value: anything)."""


def worker_scope(factories: list[ContextFactory]) -> contextlib.ExitStack:
    """Enter, in a worker thread, the thread-local contexts of the running program
    (``factories``: callables returning context managers, such as torch function
    modes, which do not follow a call into other threads)."""
    stack = contextlib.ExitStack()
    for factory in factories:
        stack.enter_context(factory())
    return stack


def _marked() -> list:
    return _state.losses


def mark_loss(tensor: torch.Tensor) -> None:
    """Record ``tensor`` as a loss produced by ``identity_loss`` in this forward."""
    _state.losses.append(tensor)


def marked_losses() -> list:
    """This thread's list of marked losses itself (hot paths clear it in place)."""
    return _marked()


def take_marked_losses() -> list:
    """Return and clear the losses marked since the last call (this thread only)."""
    marked = _marked()
    out = list(marked)
    marked.clear()
    return out


def overlap_checker() -> OverlapChecker | None:
    """The checker of overlap markers active in this thread (None: markers only record
    their hint)."""
    return _state.overlap


def set_overlap_checker(checker: OverlapChecker | None) -> OverlapChecker | None:
    """Make ``checker`` this thread's overlap-marker checker; returns the previous one."""
    previous, _state.overlap = _state.overlap, checker
    return previous
