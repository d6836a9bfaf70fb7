"""Profiling (``Options.enableProfiling(profile_dir)``) and executable caching
(``Options.enableExecutableCaching(path)``).

Profiling runs each call's device program under :py:mod:`torch.profiler` and writes one
Chrome / Perfetto trace (JSON, open it in ``chrome://tracing`` or ui.perfetto.dev) per
call: ``<profile_dir>/<name>.<training|inference>.call<N>.json``, where ``name`` is
``Options.modelName`` or the model's class name and ``N`` counts the calls of this
compiled model from 0. Profile a few calls, not a whole training run: each trace is
written when its call ends.

Caching points the inductor backend's caches (compiled graphs, autograd graphs) at the
directory, so that another process compiling the same model starts faster. torch keeps
one cache directory per process (``TORCHINDUCTOR_CACHE_DIR``), so the last model
compiled with caching chooses it. The eager backend generates no code: there is nothing
to cache, which is logged once at INFO.
"""
from __future__ import annotations

import os
from typing import Any

import torch

from .._logging import info_once, logger


class CallProfiler:
    """Context manager: profiles one call and writes its trace (module docstring)."""

    def __init__(self, directory: str, name: str, device: torch.device) -> None:
        self.directory = directory
        self.name = name
        self.calls = 0
        self.activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            self.activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._profile: Any = None
        self.last_trace: str | None = None

    def __enter__(self) -> None:
        self._profile = torch.profiler.profile(activities=self.activities)
        self._profile.__enter__()

    def __exit__(self, *exc: Any) -> None:
        profile, self._profile = self._profile, None
        profile.__exit__(*exc)
        if exc[0] is not None:
            return
        os.makedirs(self.directory, exist_ok=True)
        path = os.path.join(self.directory, f"{self.name}.call{self.calls}.json")
        profile.export_chrome_trace(path)
        self.calls += 1
        self.last_trace = path
        info_once(("profile", self.directory, self.name),
                  "Profiling %s: one trace per call in %s", self.name, self.directory)
        logger.debug("Profile of call %d written to %s", self.calls - 1, path)


def configure_executable_cache(path: str | None, backend: str) -> None:
    """Point torch's compiler caches at ``path`` for the inductor backend."""
    if path is None:
        return
    if backend != "inductor":
        info_once(("executable-cache", backend),
                  "enableExecutableCaching(%r): the %s backend generates no code, so "
                  "there is nothing to cache (recorded only).", path, backend)
        return
    path = os.path.abspath(path)
    os.makedirs(path, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = path
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config
    inductor_config.fx_graph_cache = True
    functorch_config.enable_autograd_cache = True
    info_once(("executable-cache", path), "Caching compiled programs in %s", path)
