"""Compile hooks and the at-exit cleanup.

``registerPreCompileHook``/``registerPostCompileHook`` add callables that the executor
runs (through :func:`run_pre_compile_hooks` / :func:`run_post_compile_hooks`) just before
and just after it compiles a model. ``poptorchAtExit`` runs the cleanups other modules
registered with :func:`register_at_exit` (for example releasing devices or stopping data
loader workers); it is registered with :mod:`atexit` and runs at most once.
"""
from __future__ import annotations

import atexit
import collections
import threading
from collections.abc import Callable

from torch.utils.hooks import RemovableHandle

from .._logging import logger
from ..errors import PoptorchRuntimeError

__all__ = [
    "poptorchAtExit",
    "registerPostCompileHook",
    "registerPreCompileHook",
    "register_at_exit",
    "run_post_compile_hooks",
    "run_pre_compile_hooks",
]

_pre_compile_hooks: collections.OrderedDict[int, Callable] = collections.OrderedDict()
_post_compile_hooks: collections.OrderedDict[int, Callable] = collections.OrderedDict()
_at_exit: list[Callable[[], None]] = []
_at_exit_lock = threading.Lock()


def _register(hooks: collections.OrderedDict, hook: Callable, kind: str) -> RemovableHandle:
    if not callable(hook):
        raise PoptorchRuntimeError(f"{kind} hook must be callable, got {type(hook).__name__}.")
    handle = RemovableHandle(hooks)
    hooks[handle.id] = hook
    return handle


def registerPreCompileHook(hook: Callable) -> RemovableHandle:
    """Call ``hook()`` before each model compilation; ``.remove()`` the handle to stop."""
    return _register(_pre_compile_hooks, hook, "Pre-compile")


def registerPostCompileHook(hook: Callable) -> RemovableHandle:
    """Call ``hook()`` after each model compilation; ``.remove()`` the handle to stop."""
    return _register(_post_compile_hooks, hook, "Post-compile")


def run_pre_compile_hooks() -> None:
    """Run the pre-compile hooks in registration order (called by the executor)."""
    for hook in list(_pre_compile_hooks.values()):
        hook()


def run_post_compile_hooks() -> None:
    """Run the post-compile hooks in registration order (called by the executor)."""
    for hook in list(_post_compile_hooks.values()):
        hook()


def register_at_exit(cleanup: Callable[[], None]) -> None:
    """Have :func:`poptorchAtExit` call ``cleanup()`` (latest registered runs first)."""
    if not callable(cleanup):
        raise TypeError(f"cleanup must be callable, got {type(cleanup).__name__}.")
    with _at_exit_lock:
        _at_exit.append(cleanup)


def poptorchAtExit() -> None:
    """Run and forget the registered cleanups, newest first; errors are logged, not raised.

    Called automatically when the interpreter exits; calling it earlier is safe.
    """
    with _at_exit_lock:
        cleanups = list(reversed(_at_exit))
        _at_exit.clear()
    for cleanup in cleanups:
        try:
            cleanup()
        except Exception as error:
            logger.warning("poptorchAtExit: cleanup %r failed: %s", cleanup, error)


atexit.register(poptorchAtExit)
