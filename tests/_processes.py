"""Helpers of the data-loader process tests: live child processes, polling."""
import time

import psutil


def _alive(process: psutil.Process) -> bool:
    """Whether ``process`` still runs; one that exits while we look is not alive."""
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (exists and is not a zombie)."""
    try:
        return _alive(psutil.Process(pid))
    except psutil.NoSuchProcess:
        return False


def children() -> set:
    """Pids of this process's live (not zombie) descendants.

    A child may exit between being listed and being inspected (a worker that has
    just finished); it counts as gone rather than failing the test.
    """
    return {p.pid for p in psutil.Process().children(recursive=True) if _alive(p)}


def wait_until(predicate, timeout: float = 10.0) -> bool:
    """Poll ``predicate`` until it holds or ``timeout`` seconds pass; its last value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()
