"""The backend a model's trial chose, kept as the starting point of the next run.

The automatic backend measures the compiled backend against the eager one over a
model's first calls (``program/backend_trial.py``). Measuring again costs calls at
the slower path's speed, so the choice is written down, keyed like an
executable-cache entry (versions, options, model, optimizer, inputs: ``cache.py``),
and a later run of the same program starts on the same backend. It is a starting
point, not a verdict: the run confirms it with the steady-state check of
``backend_trial.py`` and writes the choice again when the check changes it. A
decision records the machine and the torch release it was measured on
(:py:func:`machine_record`); one made elsewhere is ignored. A model saved with
``save`` / ``compileAndExport`` carries its choice in the file as well.

Where: the folder of ``Options.enableExecutableCaching`` when set, else
``POPTORCH_BACKEND_DECISIONS`` (a folder, or ``off``), else
``<temp dir>/poptorch_<user>/decisions``, as torch keeps its own compile cache. A file
that cannot be read or written is ignored (logged at DEBUG): the trial runs again.
"""
from __future__ import annotations

import functools
import getpass
import hashlib
import json
import os
import platform
import tempfile
from typing import NamedTuple

import torch

from ..._logging import logger

__all__ = ["Decision", "DecisionStore", "decisions_folder", "machine_record"]

ENV = "POPTORCH_BACKEND_DECISIONS"
CHOICES = ("compiled", "eager")


class Decision(NamedTuple):
    """A stored choice: the backend, and the trial's compiled / eager time ratio (None
    when no trial measured it, e.g. a forced or failed compiled backend)."""

    backend: str
    ratio: float | None


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


@functools.cache
def _cpu_model() -> str:
    """The processor's model name (Linux: /proc/cpuinfo), else platform's word for it."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.lower().startswith(("model name", "hardware", "cpu model")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def machine_record(device: torch.device | None = None) -> dict[str, str]:
    """What makes timings comparable: the processor, how many cores, the GPU the
    program runs on (``device``, when a CUDA device) and the torch release."""
    gpu = ""
    if device is not None and device.type == "cuda":
        gpu = torch.cuda.get_device_name(device)
    return {"machine": platform.machine(), "cpu": _cpu_model(),
            "cpus": str(os.cpu_count()), "gpu": gpu, "torch": torch.__version__}


class DecisionStore:
    """The stored decision of one program (``key``) in ``folder``."""

    def __init__(self, folder: str | None, key: str) -> None:
        digest = hashlib.sha256(key.encode()).hexdigest()[:40]
        self.path = None if folder is None else os.path.join(folder, f"{digest}.json")

    def read(self, device: torch.device | None = None) -> Decision | None:
        """The stored decision, or None (none, unreadable, or made on another machine
        or torch release than ``machine_record(device)``)."""
        if self.path is None or not os.path.exists(self.path):
            return None
        try:
            with open(self.path, encoding="utf-8") as f:
                stored = json.load(f)
            choice, ratio, machine = stored["backend"], stored.get("ratio"), \
                stored["machine"]
        except (OSError, ValueError, KeyError, TypeError) as error:
            logger.debug("Backend decision %s unreadable (%s): measuring again.",
                         self.path, error)
            return None
        here = machine_record(device)
        if machine != here:
            logger.debug("Backend decision %s was made on %s, not here (%s): measuring "
                         "again.", self.path, machine, here)
            return None
        if choice not in CHOICES or not (ratio is None or isinstance(ratio, float)):
            return None
        return Decision(choice, ratio)

    def write(self, decision: Decision, reason: str,
              device: torch.device | None = None) -> None:
        """Keep ``decision`` (written atomically; failures are logged at DEBUG)."""
        if self.path is None:
            return
        try:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            fd, temporary = tempfile.mkstemp(dir=os.path.dirname(self.path), suffix=".tmp")
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump({"backend": decision.backend, "ratio": decision.ratio,
                           "reason": reason, "machine": machine_record(device)}, f)
            os.replace(temporary, self.path)
        except OSError as error:
            logger.debug("Backend decision not kept in %s: %s", self.path, error)
