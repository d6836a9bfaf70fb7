"""Where an executor's compiled program comes from and where it goes.

One :py:class:`ProgramSource` per compiled executor decides, at compile time:

* a model restored from a precompiled file (``poptorch.load`` / ``loadExecutable``)
  checks every call's inputs against the exported :py:class:`InputSignature` and
  installs the file's compiled artefacts before its first call;
* otherwise, with ``enableExecutableCaching`` and a compiling backend, the cache entry
  for this model, options and inputs is installed if there is a usable one, and written
  after the first call if there was none.

Its :py:meth:`first_call` context manager surrounds the executor's first call.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

from ..._logging import logger
from . import artifacts
from . import cache as executable_cache
from .signature import InputSignature


class ProgramSource:
    """See module docstring."""

    def __init__(self, *, backend: str | None, signature: InputSignature,
                 precompiled: dict | None, cache_dir: str | None,
                 key_parts: dict) -> None:
        self.backend = backend
        self.compiles = backend not in (None, "eager")
        self.signature = signature
        self.expected = None
        self.installed = False
        # The compiled step compiles at the first or second call: the first two calls
        # run under first_call(), and the cache entry is written after each.
        self.warmup_calls = 2
        self.cache_dir = cache_dir if backend is not None and self.compiles else None
        self.cache_key: str | None = None
        if cache_dir is not None:
            executable_cache.note_backend(cache_dir, backend)
        if precompiled is not None:
            self.expected = precompiled["signature"]  # checked by the executor already
            self.installed = self.compiles and self._install(precompiled.get("artifacts"),
                                                             "the precompiled file")
        if self.cache_dir is not None and backend is not None and not self.installed:
            self.cache_key = executable_cache.cache_key(
                backend=backend, training=key_parts["training"],
                options=key_parts["options"], model=key_parts["model"],
                optimizer=key_parts["optimizer"], signature=signature,
                version=key_parts["version"])
            found = executable_cache.read(self.cache_dir, self.cache_key)
            self.installed = found is not None and self._install(found, "the cache")
            if self.installed:
                self.cache_key = None  # nothing to write back

    @staticmethod
    def _install(compiled: dict | None, where: str) -> bool:
        if compiled is None:
            return False
        why = artifacts.check(compiled)
        if why is not None:
            logger.warning("The compiled program in %s cannot be used (%s): compiling "
                           "again.", where, why)
            return False
        try:
            return artifacts.install(compiled)
        except Exception as e:  # a cache folder we cannot write to, ...
            logger.warning("Could not install the compiled program from %s (%s): "
                           "compiling again.", where, e)
            return False

    def check(self, args: tuple, kwargs: dict) -> None:
        """Precompiled models only: raise ``poptorch.Error`` on inputs that differ."""
        if self.expected is not None:
            self.expected.check(args, kwargs)

    @contextlib.contextmanager
    def first_call(self) -> Iterator[None]:
        """Around the executor's first call: kernels come prebuilt when installed; the
        cache entry is written once the call has compiled everything."""
        self.warmup_calls -= 1
        with artifacts.prebuilt_kernels() if self.installed else contextlib.nullcontext():
            yield
        if self.cache_key is not None and self.cache_dir is not None:
            compiled = artifacts.collect()
            if compiled is not None:
                executable_cache.write(self.cache_dir, self.cache_key, compiled)
            if self.warmup_calls == 0:
                self.cache_key = None

    @property
    def fresh(self) -> bool:
        """True during the calls that may still compile (see ``first_call``)."""
        return self.warmup_calls > 0
