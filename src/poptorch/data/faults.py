"""How data-loading faults reach the caller.

* A worker process that dies (killed by a signal, out of memory) is a ``poptorch.Error``
  that names the signal: torch's ``DataLoader`` reports its own workers' deaths as a
  ``RuntimeError`` whose wording depends on the path that noticed it; both are turned into
  one message here, for torch's workers and for the asynchronous accessor's worker alike.
* An exception raised by the data set in a worker reaches the caller as the same type,
  with the worker named and the worker's traceback in its message (see
  :func:`rebuild_worker_exception`).
"""
from __future__ import annotations

import contextlib
import os
import pickle
import re
import signal
import time
from collections.abc import Iterable
from types import FrameType
from typing import Protocol, cast

from .._runtime.torch_internals import remove_worker_pids
from ..errors import Error

__all__ = [
    "WorkerDiedError",
    "as_worker_death",
    "exit_code_description",
    "install_sigchld_translation",
    "rebuild_worker_exception",
    "release_ended_workers",
    "release_shared_memory",
    "start_failure",
    "stop_torch_workers",
]


class WorkerDiedError(Error, RuntimeError):
    """A data-loading worker process died. A ``poptorch.Error``, and a ``RuntimeError``
    as torch's own report of a dead worker is, so that code written for torch's loader
    still catches it."""

# torch: "DataLoader worker (pid 123) is killed by signal: Killed." (strsignal wording)
# or "DataLoader worker (pid(s) 123, 456) exited unexpectedly".
_TORCH_KILLED = re.compile(r"DataLoader worker \(pid (\d+)\) is killed by signal: ([^.]+)")
_TORCH_EXITED = re.compile(r"DataLoader worker \(pid\(s\) ([\d, ]+)\) exited unexpectedly")


def _signal_names() -> dict[str, str]:
    names: dict[str, str] = {}
    for sig in signal.Signals:
        description = signal.strsignal(sig)
        if description:
            names.setdefault(description, sig.name)
    return names


def exit_code_description(code: int | None) -> str:
    """``"was killed by signal SIGKILL (9)"`` or ``"exited with code 3"``."""
    if code is not None and code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        hint = " (the system may have run out of memory)" if -code == signal.SIGKILL else ""
        return f"was killed by signal {name} ({-code}){hint}"
    return f"exited unexpectedly with exit code {code}"


def as_worker_death(error: BaseException, iterator: object = None) -> Error | None:
    """The ``poptorch.Error`` for torch's report of a dead ``DataLoader`` worker, or None
    when ``error`` is something else. ``iterator``: torch's iterator that raised it, whose
    worker processes tell how they ended."""
    if isinstance(error, WorkerDiedError):
        return error
    if isinstance(error, Error) or not isinstance(error, (RuntimeError, OSError,
                                                           EOFError)):
        return None
    text = str(error)
    killed = _TORCH_KILLED.search(text)
    if killed:
        pid, description = killed.groups()
        name = _signal_names().get(description.strip(), description.strip())
        return WorkerDiedError(
            f"A torch DataLoader worker process (pid {pid}) was killed by signal {name} "
            "while loading data. Its batch is lost: restart the epoch (or resume from a "
            "checkpoint, see docs/data.md).")
    exited = _TORCH_EXITED.search(text)
    if exited:
        pids = {int(pid) for pid in exited.group(1).replace(" ", "").split(",") if pid}
        how = "; ".join(
            f"pid {worker.pid} {exit_code_description(worker.exitcode)}"
            for worker in getattr(iterator, "_workers", [])
            if worker.pid in pids and worker.exitcode is not None)
        return WorkerDiedError(
            f"A torch DataLoader worker process ({how or text.strip()}) died while "
            "loading data. Its batch is lost: restart the epoch (or resume from a "
            "checkpoint, see docs/data.md).")
    # Receiving a batch from a worker that died while sending it (torch passes tensors
    # through sockets and file descriptors): the connection breaks.
    dead = _dead_workers(getattr(iterator, "_workers", []))
    if dead:
        how = "; ".join(f"pid {worker.pid} {exit_code_description(worker.exitcode)}"
                        for worker in dead)
        return WorkerDiedError(
            f"A torch DataLoader worker process ({how}) died while loading data "
            f"({type(error).__name__}: {text}). Its batch is lost: restart the epoch (or "
            "resume from a checkpoint, see docs/data.md).")
    return None


class _VerbatimMessage(str):
    """A message whose repr is itself, so that ``str(KeyError(message))`` stays
    readable (multi-line traceback included)."""

    def __repr__(self) -> str:
        return str(self)


def _dead_workers(workers: list, wait_s: float = 1.0) -> list:
    """The workers that ended badly; a broken connection comes a moment before the
    worker's exit status, so wait for it briefly."""
    deadline = time.monotonic() + wait_s
    while True:
        dead = [worker for worker in workers if worker.exitcode not in (None, 0)]
        if dead or not workers or time.monotonic() > deadline:
            return dead
        time.sleep(0.01)


def pickled_type(error: BaseException) -> bytes | None:
    """The exception's class, pickled (None for a class that cannot be, e.g. a local one:
    the caller then gets a ``poptorch.Error``)."""
    try:
        return pickle.dumps(type(error))
    except Exception:
        return None


def rebuild_worker_exception(description: str, text: str, error_type: bytes | None,
                             message: str) -> BaseException:
    """The main-process exception for an error raised in a worker: the original type where
    it can be rebuilt from a message (as torch's DataLoader does), else
    ``poptorch.Error``; the message names the worker and holds the original traceback."""
    try:
        cls = pickle.loads(error_type) if error_type is not None else None
    except Exception:
        cls = None
    name = cls.__name__ if isinstance(cls, type) else "an exception"
    full = (f"Caught {name} in {description}: {message}\n"
            f"Original traceback in the worker:\n{text}")
    if isinstance(cls, type) and issubclass(cls, Exception):
        try:
            if issubclass(cls, KeyError):  # KeyError's str() is the repr of its argument
                return cls(_VerbatimMessage(full))
            return cls(full)
        except Exception:
            pass
    return Error(full)


_START_FAILURES: dict[type, type] = {}


def start_failure(original: BaseException) -> Error:
    """The error of an ``AsynchronousDataAccessor`` whose worker could not load its first
    batch: a ``poptorch.Error`` (as upstream raises it) that is also of the original
    exception's type where Python allows (so ``except ValueError`` still catches it)."""
    message = (f"AsynchronousDataAccessor worker thread failed to start: the data set "
               f"could not produce its first batch. {original}")
    cls = type(original)
    if isinstance(original, Error) or not issubclass(cls, Exception):
        return Error(message)
    combined = _START_FAILURES.get(cls)
    if combined is None:
        try:
            combined = type(cls.__name__, (Error, cls), {
                "__module__": cls.__module__,
                "__doc__": f"poptorch.Error and {cls.__qualname__}: a data-loading "
                           "worker failed to start.",
                "__str__": Error.__str__})
        except TypeError:  # incompatible layouts (e.g. OSError subclasses)
            combined = Error
        _START_FAILURES[cls] = combined
    try:
        return combined(message)
    except Exception:
        return Error(message)


class _TorchWorkersIterator(Protocol):
    """torch's multi-process DataLoader iterator, as far as it is written here."""
    _worker_pids_set: bool


def stop_torch_workers(iterator: object) -> None:
    """Stops the workers of a torch iterator one of whose workers died. Their pids are
    unregistered from torch's SIGCHLD handler first: it would otherwise raise the death
    again (as a RuntimeError) at any later point of the program, even inside the
    shutdown itself."""
    try:
        if getattr(iterator, "_worker_pids_set", False):
            remove_worker_pids(id(iterator))
            cast(_TorchWorkersIterator, iterator)._worker_pids_set = False
    except Exception:
        pass
    shutdown = getattr(iterator, "_shutdown_workers", None)
    if shutdown is not None:
        for _ in range(3):  # a signal handler may interrupt it once; try again
            try:
                shutdown()
                break
            except Exception:
                continue
    release_ended_workers(iterator)


def release_ended_workers(iterator: object) -> None:
    """:func:`release_shared_memory` of the ended workers of a torch iterator (or of an
    iterator wrapping one as ``_inner``), after its workers were stopped."""
    workers = getattr(getattr(iterator, "_inner", iterator), "_workers", [])
    release_shared_memory(w.pid for w in workers if w.exitcode is not None)


def release_shared_memory(pids: Iterable[int | None]) -> None:
    """Remove the ``/dev/shm`` names left by worker processes that have ended. torch
    names a batch's shared memory ``torch_<pid>_...`` and unlinks the name once the
    segment is mapped; a worker killed in between leaves the name behind, holding its
    memory until reboot. Only for processes that are gone: a live one may be about to
    unlink its own."""
    prefixes = tuple(f"torch_{pid}_" for pid in pids if pid is not None)
    if not prefixes:
        return
    try:
        names = os.listdir(_SHM_DIR)
    except OSError:  # no /dev/shm (macOS): nothing is left there
        return
    for name in names:
        if name.startswith(prefixes):
            with contextlib.suppress(OSError):  # already gone, or not ours to remove
                os.unlink(os.path.join(_SHM_DIR, name))


_SHM_DIR = "/dev/shm"


def install_sigchld_translation() -> None:
    """torch's SIGCHLD handler raises a worker's death as a ``RuntimeError`` wherever the
    main thread happens to be; wrapped, it raises the same death as a
    :class:`WorkerDiedError` (still a ``RuntimeError``). Installed after torch installed
    its handler (its first multi-worker iterator), once."""
    import threading
    if threading.current_thread() is not threading.main_thread():
        return
    current = signal.getsignal(signal.SIGCHLD)
    if not callable(current) or getattr(current, "_poptorch_translates", False):
        return

    reported: set[str] = set()

    def translating_handler(signum: int, frame: FrameType | None) -> None:
        try:
            current(signum, frame)
        except RuntimeError as error:
            death = as_worker_death(error)
            if death is None:
                raise
            if str(death) in reported:  # torch raises it again at every SIGCHLD
                return
            reported.add(str(death))
            raise death from error

    translating_handler._poptorch_translates = True  # type: ignore[attr-defined]  # (a function attribute: ours, see above)
    signal.signal(signal.SIGCHLD, translating_handler)
