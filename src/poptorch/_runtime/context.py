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


def worker_scope(factories: list) -> contextlib.ExitStack:
    """Enter, in a worker thread, the thread-local contexts of the running program
    (``factories``: callables returning context managers, such as torch function
    modes, which do not follow a call into other threads)."""
    stack = contextlib.ExitStack()
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
