"""The IPU toolchain's environment variables that PopTorch programs set:
``POPLAR_ENGINE_OPTIONS`` and ``PVTI_OPTIONS``, each a JSON object. Parsed here only;
the profiler (``tracing.py``) reads the profiling requests, the executor logs the
settings that have no effect off an IPU (``executor/ipu_environment.py``)."""
from __future__ import annotations

import json
import os

from ..errors import Error

__all__ = ["ENGINE_OPTIONS", "PVTI_OPTIONS", "json_options", "text"]

ENGINE_OPTIONS = "POPLAR_ENGINE_OPTIONS"
PVTI_OPTIONS = "PVTI_OPTIONS"


def text(name: str) -> str:
    """The value of environment variable ``name``, stripped ("" when unset)."""
    return os.environ.get(name, "").strip()


def json_options(name: str) -> dict:
    """The JSON object in environment variable ``name`` ({} when unset or empty); a
    value that is not a JSON object is a :py:class:`poptorch.Error` (Poplar refuses
    it on an IPU too)."""
    value_text = text(name)
    if not value_text:
        return {}
    try:
        value = json.loads(value_text)
    except json.JSONDecodeError as e:
        raise Error(f"{name} is not valid JSON ({e}): expected for example "
                    f"{name}='{{\"autoReport.all\":\"true\"}}'.") from e
    if not isinstance(value, dict):
        raise Error(f"{name} must be a JSON object, got {value_text!r}.")
    return value
