"""Substitution managers: libraries swap their own functions in while a model runs.

PopTorch lets a library register a *substitution manager* (PopTorch Geometric registers
one that puts static-shape versions of ``torch_geometric`` ops in place). The executor
enters :func:`substitutions` around every call of a wrapped model, compiling included:
each registered manager's ``replace()`` runs before the model and its ``restore()``
after, also when the call raises.

A manager is a class whose instances have ``replace()`` and ``restore()``; it is
registered with ``poptorch._poplar_executor._OverwriteContextManager
.registerSubsitutionManager(cls)`` (PopTorch's name, spelling included) or
:func:`register_substitution_manager`.
"""
from __future__ import annotations

import contextlib
import threading
from types import TracebackType
from typing import Any, ClassVar, Protocol

from .errors import Error

__all__ = [
    "SUBSTITUTION_TYPES",
    "SubstitutionManager",
    "_OverwriteContextManager",
    "register_substitution_manager",
    "substitutions",
    "substitutions_active",
]


class SubstitutionManager(Protocol):
    """What a registered manager's instances provide."""

    def replace(self) -> None: ...

    def restore(self) -> None: ...


def _check_manager_type(manager_type: Any) -> None:
    if not isinstance(manager_type, type):
        raise Error(f"registerSubsitutionManager: expected a class whose instances have "
                    f"replace() and restore(), got {manager_type!r}.")
    missing = [name for name in ("replace", "restore")
               if not callable(getattr(manager_type, name, None))]
    if missing:
        raise Error(f"registerSubsitutionManager: {manager_type.__qualname__} has no "
                    f"{' / '.join(missing)} method; a substitution manager needs both "
                    "replace() and restore().")


class _OverwriteContextManager:
    """Enters every registered substitution manager (PopTorch's class of that name).

    ``with _OverwriteContextManager():`` creates one instance of each registered type,
    calls their ``replace()`` in registration order and their ``restore()`` in reverse
    order on the way out. If a ``replace()`` raises, the managers already replaced are
    restored before the error propagates.
    """

    _subsitution_manager_types: ClassVar[list[type]] = []

    def __init__(self) -> None:
        self.substitution_managers = [
            manager_type() for manager_type in type(self)._subsitution_manager_types]
        self._replaced: list[Any] = []

    def __enter__(self) -> _OverwriteContextManager:
        try:
            for manager in self.substitution_managers:
                manager.replace()
                self._replaced.append(manager)
        except BaseException:
            self._restore()
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, value: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self._restore()

    def _restore(self) -> None:
        """Restore in reverse order; every manager is restored even if one raises."""
        first_error: BaseException | None = None
        while self._replaced:
            manager = self._replaced.pop()
            try:
                manager.restore()
            except BaseException as error:
                first_error = first_error or error
        if first_error is not None:
            raise first_error

    @classmethod
    def registerSubsitutionManager(cls, type: type) -> None:
        """Register a substitution manager class (once; registering again does nothing)."""
        register_substitution_manager(type)


def register_substitution_manager(manager_type: type) -> None:
    """Register ``manager_type``; the executor enters it around every model call."""
    _check_manager_type(manager_type)
    types = _OverwriteContextManager._subsitution_manager_types
    with _STATE.lock:
        if manager_type not in types:
            types.append(manager_type)


class _SubstitutionState:
    """Process-wide nesting count: replaced on the outermost entry, restored on its exit.

    Substitutions change module attributes, which every thread sees; a call that starts
    while another is running (a nested executor call, or a second thread) finds them in
    place already and leaves restoring to the outermost one.
    """

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.depth = 0
        self.active: _OverwriteContextManager | None = None


_STATE = _SubstitutionState()


class _Substitutions:
    """The context :func:`substitutions` returns while managers are registered."""

    def __enter__(self) -> None:
        with _STATE.lock:
            if _STATE.depth == 0:
                active = _OverwriteContextManager()
                active.__enter__()
                _STATE.active = active
            _STATE.depth += 1

    def __exit__(self, exc_type: type[BaseException] | None, value: BaseException | None,
                 traceback: TracebackType | None) -> None:
        with _STATE.lock:
            _STATE.depth -= 1
            if _STATE.depth == 0:
                active, _STATE.active = _STATE.active, None
                assert active is not None
                active.__exit__(exc_type, value, traceback)


SUBSTITUTION_TYPES = _OverwriteContextManager._subsitution_manager_types
"""The registered manager types: the registry's one list, changed in place (a hot path's
check that any is registered)."""
_NOTHING_REGISTERED = contextlib.nullcontext()
_ACTIVE = _Substitutions()


def substitutions() -> contextlib.AbstractContextManager:
    """The context the executor enters around a model call (cheap with no managers)."""
    if not SUBSTITUTION_TYPES:
        return _NOTHING_REGISTERED
    return _ACTIVE


def substitutions_active() -> bool:
    """True while a model call has the registered substitutions in place."""
    return _STATE.depth > 0
