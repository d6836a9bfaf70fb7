"""pytest plugin of ``benchmarks/gpu_check.sh`` (``-p gpu_check_progress``): writes the
ids of the collected tests and of each finished one to ``$GPU_CHECK_PROGRESS`` as they
happen, so that a test run stopped at its time budget can list exactly what did not
run; and lets that budget's SIGINT end the run cleanly (pytest's summary) even where the
check was started with SIGINT ignored (a background job, ``nohup``)."""
from __future__ import annotations

import os
import signal
from typing import Any


def pytest_configure(config: Any) -> None:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def _write(line: str) -> None:
    path = os.environ.get("GPU_CHECK_PROGRESS")
    if path:
        with open(path, "a") as progress:
            progress.write(line + "\n")


def pytest_collection_finish(session: Any) -> None:
    for item in session.items:
        _write(f"collected {item.nodeid}")


def pytest_runtest_logfinish(nodeid: str, location: Any) -> None:
    _write(f"done {nodeid}")
