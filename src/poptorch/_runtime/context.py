"""Process-wide execution state shared by the executor and the ops.

* whether a model is running "on the IPU" right now (``poptorch.isRunningOnIpu``);
* the tensors that ``poptorch.identity_loss`` marked as the loss of the current forward.
"""
from __future__ import annotations

import contextlib
import threading

import torch

_state = threading.local()


def is_running_on_ipu() -> bool:
    """True only while an executor runs the wrapped model."""
    return getattr(_state, "depth", 0) > 0


class running_on_ipu:
    """Context manager marking the model as running on the IPU (re-entrant, per thread)."""

    def __enter__(self) -> "running_on_ipu":
        _state.depth = getattr(_state, "depth", 0) + 1
        return self

    def __exit__(self, *exc) -> None:
        _state.depth -= 1


_worker_factories: list = []  # process-wide: worker threads of the running program
_worker_lock = threading.Lock()


class worker_contexts:
    """While a program runs, make ``factories`` (callables returning context managers:
    thread-local state such as torch function modes) available to its worker threads."""

    def __init__(self, factories: list) -> None:
        self.factories = list(factories)

    def __enter__(self) -> "worker_contexts":
        with _worker_lock:
            _worker_factories.append(self.factories)
        return self

    def __exit__(self, *exc) -> None:
        with _worker_lock:
            _worker_factories.remove(self.factories)


def worker_scope() -> contextlib.ExitStack:
    """Enter, in a worker thread, the contexts published by the running program."""
    stack = contextlib.ExitStack()
    with _worker_lock:
        factories = [f for group in _worker_factories for f in group]
    for factory in factories:
        stack.enter_context(factory())
    return stack


def _marked() -> list:
    marked = getattr(_state, "losses", None)
    if marked is None:
        marked = _state.losses = []
    return marked


def mark_loss(tensor: torch.Tensor) -> None:
    """Record ``tensor`` as a loss produced by ``identity_loss`` in this forward."""
    _marked().append(tensor)


def take_marked_losses() -> list:
    """Return and clear the losses marked since the last call (this thread only)."""
    marked = _marked()
    out = list(marked)
    marked.clear()
    return out
