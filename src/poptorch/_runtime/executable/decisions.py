"""The backend a model's trial chose, kept for the next run on the same machine.

The automatic backend measures the compiled backend against the eager one over a
model's first calls (``program/backend_trial.py``). Timings on a shared machine vary,
so two runs of one program could choose differently and give different numbers (the
compiled kernels round differently). The choice is therefore written down, keyed like
an executable-cache entry (versions, options, model, optimizer, inputs: ``cache.py``)
plus this machine, and a later run of the same program on the same machine takes the
same backend without measuring again. A model saved with ``save`` /
``compileAndExport`` carries its choice in the file as well.

Where: the folder of ``Options.enableExecutableCaching`` when set, else
``POPTORCH_BACKEND_DECISIONS`` (a folder, or ``off``), else
``<temp dir>/poptorch_<user>/decisions``, as torch keeps its own compile cache. A file
that cannot be read or written is ignored (logged at DEBUG): the trial runs again.
"""
from __future__ import annotations

import getpass
import hashlib
import json
import os
import platform
import tempfile

from ..._logging import logger

__all__ = ["DecisionStore", "decisions_folder", "machine_key"]

ENV = "POPTORCH_BACKEND_DECISIONS"
CHOICES = ("compiled", "eager")


def decisions_folder(cache_dir: str | None) -> str | None:
    """Where decisions are kept (module docstring); None when turned off."""
    if cache_dir is not None:
        return os.path.join(cache_dir, "decisions")
    setting = os.environ.get(ENV, "").strip()
    if setting.lower() in ("off", "0", "false", "no"):
        return None
    if setting:
        return setting
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no user name in this environment
        user = str(os.getuid()) if hasattr(os, "getuid") else "user"
    return os.path.join(tempfile.gettempdir(), f"poptorch_{user}", "decisions")


def machine_key() -> str:
    """What makes timings comparable: the host and its processor."""
    return "|".join((platform.node(), platform.machine(), platform.processor(),
                     str(os.cpu_count())))


class DecisionStore:
    """The stored decision of one program (``key``) in ``folder``."""

    def __init__(self, folder: str | None, key: str) -> None:
        digest = hashlib.sha256(f"{key}|{machine_key()}".encode()).hexdigest()[:40]
        self.path = None if folder is None else os.path.join(folder, f"{digest}.json")

    def read(self) -> str | None:
        """The stored choice ("compiled" or "eager"), or None."""
        if self.path is None or not os.path.exists(self.path):
            return None
        try:
            with open(self.path, encoding="utf-8") as f:
                choice = json.load(f).get("backend")
        except (OSError, ValueError, AttributeError) as error:
            logger.debug("Backend decision %s unreadable (%s): measuring again.",
                         self.path, error)
            return None
        return choice if choice in CHOICES else None

    def write(self, choice: str, reason: str) -> None:
        """Keep ``choice`` (written atomically; failures are logged at DEBUG)."""
        if self.path is None:
            return
        try:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            fd, temporary = tempfile.mkstemp(dir=os.path.dirname(self.path), suffix=".tmp")
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump({"backend": choice, "reason": reason}, f)
            os.replace(temporary, self.path)
        except OSError as error:
            logger.debug("Backend decision not kept in %s: %s", self.path, error)
