"""Environment variables that tune the IPU toolchain: ``POPLAR_ENGINE_OPTIONS`` and
``PVTI_OPTIONS``.

When they ask for profiling (``autoReport.*`` engine options, ``{"enable": "true"}`` for
PVTI) the profiling support handles them. Any other setting tunes Poplar or its trace
library on an IPU and has no effect here: logged once at INFO when a model compiles.
"""
from __future__ import annotations

from .._logging import info_once
from .._runtime.environment import ENGINE_OPTIONS, PVTI_OPTIONS, json_options, text
from ..errors import Error

__all__ = ["log_ipu_only_environment"]


def _json(name: str) -> dict | None:
    try:
        return json_options(name)
    except Error:  # (the profiler refuses it when it reads it)
        return None


def _truthy(value: object) -> bool:
    return value is True or str(value).lower() == "true"


def _requests_reports(options: dict) -> bool:
    return any(k.startswith("autoReport") and _truthy(v) for k, v in options.items()
               if k != "autoReport.directory")


def log_ipu_only_environment() -> None:
    """Log once the IPU-only settings found in the environment (see module docstring)."""
    engine = text(ENGINE_OPTIONS)
    if engine:
        options = _json(ENGINE_OPTIONS)
        if options is None:
            info_once(("env", "POPLAR_ENGINE_OPTIONS", engine),
                      "POPLAR_ENGINE_OPTIONS=%r is not a JSON object; on an IPU Poplar "
                      "would reject it; here it has no effect.", engine)
        elif not _requests_reports(options):
            info_once(("env", "POPLAR_ENGINE_OPTIONS", engine),
                      "POPLAR_ENGINE_OPTIONS=%r: on an IPU these Poplar engine options "
                      "tune how the graph is compiled and run; here they have no effect.",
                      engine)
    pvti = text(PVTI_OPTIONS)
    if pvti:
        options = _json(PVTI_OPTIONS)
        if options is None or not _truthy(options.get("enable")):
            info_once(("env", "PVTI_OPTIONS", pvti),
                      "PVTI_OPTIONS=%r: on an IPU system these configure the PopVision "
                      "trace instrumentation library; without {\"enable\": \"true\"} "
                      "(profiling) they have no effect here.", pvti)
