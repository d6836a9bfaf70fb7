"""Executable caching (``Options.enableExecutableCaching(path)``, ``POPTORCH_CACHE_DIR``).

With a compiling backend, the first call of a model stores the compiled program's
artefacts (``artifacts.py`` beside this module) in ``<path>/<key>.popcache``; a later process
compiling the same model with the same options and inputs installs them before its
first call and so skips building kernels. The key hashes everything that shapes the
program: torch and OpenPopTorch versions, the backend, training or inference, the
options, the model (class, source, parameter and buffer names, shapes and dtypes), the
optimizer (class and hyperparameters) and the input signature.

An entry that cannot be read, that belongs to another key, another torch or another
format, or whose data fails its checksum is ignored with a warning: the model compiles
as if the cache were empty and the entry is replaced. The eager backend generates no
code, so there is nothing to cache (recorded and logged once at INFO).
"""
from __future__ import annotations

import hashlib
import inspect
import io
import json
import os
import pickle
import re
import tempfile
from collections.abc import Mapping
from typing import TYPE_CHECKING, NoReturn

import torch

from ..._logging import info_once, logger
from ..._typing import OptionValue
from . import artifacts

if TYPE_CHECKING:
    from .signature import InputSignature

SUFFIX = ".popcache"
MAGIC = b"OPENPOPTORCH-EXECUTABLE-CACHE\n"
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
# Options that say where things go, not what is computed: moving the cache folder or
# turning logs on must not invalidate the cache.
_NOT_IN_KEY = ("executable_cache_dir", "profile_dir", "log_dir", "max_repeat_logs",
               "show_compilation_progress_bar", "model_name")


def _model_description(model: torch.nn.Module) -> list:
    classes = []
    for module in model.modules():
        cls = type(module)
        try:
            source = hashlib.sha256(inspect.getsource(cls).encode()).hexdigest()
        except (OSError, TypeError):
            source = ""
        classes.append(f"{cls.__module__}.{cls.__qualname__}:{source}")
    tensors = [(name, tuple(t.shape), str(t.dtype), t.requires_grad)
               for name, t in list(model.named_parameters()) + list(model.named_buffers())]
    return [sorted(set(classes)), tensors]


def _optimizer_description(optimizer: object) -> list:
    if optimizer is None:
        return []
    groups = [{k: v for k, v in g.items() if k != "params"}
              for g in getattr(optimizer, "param_groups", [])]
    return [type(optimizer).__qualname__, groups]


def cache_key(*, backend: str, training: bool, options: Mapping[str, OptionValue],
              model: torch.nn.Module, optimizer: object, signature: InputSignature,
              version: str) -> str:
    """The key of a compiled program (module docstring); ``options`` are the model's
    options as ``Options.toDict()`` gives them."""
    parts = {
        "torch": torch.__version__, "poptorch": version, "backend": backend,
        "training": training,
        "options": {k: v for k, v in options.items() if k not in _NOT_IN_KEY},
        "model": _model_description(model),
        "optimizer": _optimizer_description(optimizer),
        "inputs": signature.key(),
    }
    text = _ADDRESS.sub("", json.dumps(parts, sort_keys=True, default=repr))
    return hashlib.sha256(text.encode()).hexdigest()[:40]


def entry_path(folder: str, key: str) -> str:
    return os.path.join(os.path.abspath(folder), key + SUFFIX)


class _PlainUnpickler(pickle.Unpickler):
    """Entries hold only plain data (dicts, bytes, str, ...): refuse any class, so that
    a foreign file can never run code while being read."""

    def find_class(self, module: str, name: str) -> NoReturn:
        raise pickle.UnpicklingError(f"unexpected object {module}.{name}")


def read(folder: str, key: str) -> dict | None:
    """The usable artefacts stored for ``key``, or None (missing: silently; unusable:
    with a warning, see module docstring)."""
    path = entry_path(folder, key)
    if not os.path.exists(path):
        return None
    try:
        with open(path, "rb") as f:
            if f.read(len(MAGIC)) != MAGIC:
                raise ValueError("not an OpenPopTorch executable-cache entry")
            digest = f.read(64).decode("ascii")
            body = f.read()
        if hashlib.sha256(body).hexdigest() != digest:
            raise ValueError("checksum mismatch (truncated or damaged file)")
        entry = _PlainUnpickler(io.BytesIO(body)).load()
        if not isinstance(entry, dict) or entry.get("key") != key:
            raise ValueError("the entry belongs to another model or options")
        why = artifacts.check(entry.get("artifacts"))
        if why is not None:
            raise ValueError(why)
    except Exception as e:  # corrupt or foreign: never trusted, never fatal
        logger.warning("Executable cache: ignoring %s (%s); compiling from scratch, the "
                       "entry will be replaced.", path, e)
        return None
    return entry["artifacts"]


def write(folder: str, key: str, compiled: dict) -> str | None:
    """Store ``compiled`` artefacts for ``key`` (atomically: readers never see half a
    file). Returns the path, or None when the folder is not writable (warning)."""
    path = entry_path(folder, key)
    body = pickle.dumps({"key": key, "artifacts": compiled},
                        protocol=pickle.HIGHEST_PROTOCOL)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(MAGIC + hashlib.sha256(body).hexdigest().encode("ascii") + body)
        os.replace(tmp, path)
    except OSError as e:
        logger.warning("Executable cache: cannot write %s (%s); not caching.", path, e)
        return None
    logger.debug("Executable cache: stored %s", path)
    return path


def note_backend(folder: str, backend: str | None) -> bool:
    """Log once what caching does for ``backend`` (None: a model-parallel runner, which
    runs eagerly); True if the backend compiles."""
    if backend in (None, "eager"):
        what = "the eager backend" if backend else "model-parallel execution"
        info_once(("executable-cache", backend, folder),
                  "enableExecutableCaching(%r): %s generates no code, so there is "
                  "nothing to cache (recorded only).", folder, what)
        return False
    info_once(("executable-cache", folder), "Caching compiled programs in %s", folder)
    return True
