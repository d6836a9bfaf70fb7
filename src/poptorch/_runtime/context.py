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
from typing import Any, Generic, Protocol, TypeVar

import torch

from .._typing import UserInput, UserOutput
from ..enums import OverlapMode


class OverlapChecker(Protocol):
    """What the overlap markers report to while a model is captured or its first
    forward runs: each returns what the marker returns in place of ``structure``."""

    def mark_input(self, structure: UserInput, mode: OverlapMode) -> UserInput: ...

    def mark_output(self, structure: UserOutput, mode: OverlapMode) -> UserOutput: ...


_S = TypeVar("_S")


class ThreadState:
    """What one thread is running: ``depth`` counts the executor calls running in it,
    ``training`` those of a training model, ``losses`` are the losses marked by
    ``identity_loss`` in the current forward, ``overlap`` the marker checker of a
    capture or a first forward (if one runs)."""

    __slots__ = ("depth", "losses", "overlap", "training")

    def __init__(self) -> None:
        self.depth = 0
        self.training = 0
        self.losses: list = []
        self.overlap: OverlapChecker | None = None


class PerThread(threading.local, Generic[_S]):
    """One ``make()`` per thread, as ``state`` (``threading.local`` calls ``__init__``
    with the same arguments in every thread that reads it). Reading a thread-local
    attribute costs several times a plain one, so a hot path reads ``state`` once and
    then plain attributes."""

    def __init__(self, make: Callable[[], _S]) -> None:
        self.state = make()


_per_thread = PerThread(ThreadState)


def thread_state() -> ThreadState:
    """This thread's :py:class:`ThreadState`."""
    return _per_thread.state


def is_running_on_ipu() -> bool:
    """True only while an executor runs the wrapped model."""
    return _per_thread.state.depth > 0


def is_running_training() -> bool:
    """True only while an executor runs the wrapped model of a ``trainingModel`` (in
    the thread that runs its forward and backward passes)."""
    return _per_thread.state.training > 0


class running_on_ipu:
    """Context manager marking the model as running on the IPU (re-entrant, per thread);
    ``training``: the model is a training model's."""

    def __init__(self, training: bool = False) -> None:
        self._training = 1 if training else 0

    def __enter__(self) -> running_on_ipu:
        state = _per_thread.state
        state.depth += 1
        state.training += self._training
        return self

    def __exit__(self, *exc: object) -> None:
        state = _per_thread.state
        state.depth -= 1
        state.training -= self._training


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


def mark_loss(tensor: torch.Tensor) -> None:
    """Record ``tensor`` as a loss produced by ``identity_loss`` in this forward."""
    _per_thread.state.losses.append(tensor)


def marked_losses() -> list:
    """This thread's list of marked losses itself (hot paths clear it in place)."""
    return _per_thread.state.losses


def take_marked_losses() -> list:
    """Return and clear the losses marked since the last call (this thread only)."""
    marked = _per_thread.state.losses
    out = list(marked)
    marked.clear()
    return out


def overlap_checker() -> OverlapChecker | None:
    """The checker of overlap markers active in this thread (None: markers only record
    their hint)."""
    return _per_thread.state.overlap


def set_overlap_checker(checker: OverlapChecker | None) -> OverlapChecker | None:
    """Make ``checker`` this thread's overlap-marker checker; returns the previous one."""
    state = _per_thread.state
    previous, state.overlap = state.overlap, checker
    return previous
