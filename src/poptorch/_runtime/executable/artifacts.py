"""Compiled-program artefacts: what lets another process skip compilation.

A compiling backend (``torch.compile`` / inductor) leaves two kinds of artefacts:

* the entries of torch's compiler caches (FX graphs, AOT-autograd forward/backward
  graphs), which :py:func:`torch.compiler.save_cache_artifacts` serialises ("mega-cache");
* the kernel binaries those entries call, built by the C++ (or Triton) compiler. On the
  CPU these are shared libraries in inductor's cache folder, not part of the mega-cache,
  and rebuilding them is most of the compile time.

:py:func:`collect` packs both into a plain ``dict`` (stored in exported files and in
executable-cache entries); :py:func:`install` puts them back into this process's caches
and returns a context manager for the first call, during which torch finds every kernel
already built. Both are best effort by design: anything missing or unusable only means
that torch compiles again (slower, same results); it never changes what runs.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
from collections.abc import Iterator

import torch

from ..._logging import logger
from ..torch_internals import inductor_cache_dir, inductor_codecache

FORMAT = 1


def _inductor_cache_dir() -> str | None:
    try:
        return os.path.realpath(inductor_cache_dir())
    except Exception:  # pragma: no cover - torch without inductor
        return None


def _loaded_kernel_binaries(root: str) -> list[str]:
    """Shared libraries under ``root`` that this process has loaded (Linux: the memory
    map lists every library dlopen'ed, whichever torch code path loaded it)."""
    paths: list[str] = []
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            for line in maps:
                path = line.rstrip("\n").split(maxsplit=5)[-1]
                if path.startswith(root + os.sep) and path.endswith(".so") \
                        and path not in paths:
                    paths.append(path)
    except OSError:
        return []
    return paths + [p for p in _isa_probe_binaries(root) if p not in paths]


def _isa_probe_binaries(root: str) -> list[str]:
    """The tiny libraries inductor builds once per cache folder to probe the CPU's
    vector instructions (loaded by a subprocess, so absent from our memory map)."""
    found = []
    for folder in os.scandir(root):
        if not folder.is_dir() or len(folder.name) != 2:
            continue
        for entry in os.scandir(folder.path):
            if not entry.name.endswith(".cpp") or entry.stat().st_size > 4096:
                continue
            binary = entry.path[:-4] + ".so"
            try:
                with open(entry.path, encoding="utf-8", errors="replace") as f:
                    probe = "_chk_kernel" in f.read()
            except OSError:
                continue
            if probe and os.path.exists(binary):
                found.append(binary)
    return found


def collect() -> dict | None:
    """The artefacts of everything torch compiled in this process so far (None if
    nothing was compiled)."""
    try:
        saved = torch.compiler.save_cache_artifacts()
    except Exception as e:  # serialisation of an unusual graph failed
        logger.warning("Could not serialise the compiled program (%s); the file will "
                       "hold no compiled code and loading it compiles again.", e)
        return None
    if saved is None:
        return None
    binaries: dict[str, bytes] = {}
    root = _inductor_cache_dir()
    if root is not None:
        for path in _loaded_kernel_binaries(root):
            try:
                with open(path, "rb") as f:
                    binaries[os.path.relpath(path, root)] = f.read()
            except OSError:
                continue
    return {"format": FORMAT, "torch": str(torch.__version__), "cache": saved[0],
            "binaries": {rel: (hashlib.sha256(data).hexdigest(), data)
                         for rel, data in binaries.items()}}


def check(artifacts: object) -> str | None:
    """Why ``artifacts`` cannot be used here (None when they can)."""
    if not isinstance(artifacts, dict) or artifacts.get("format") != FORMAT:
        return "not compiled artefacts of this OpenPopTorch version"
    if artifacts.get("torch") != str(torch.__version__):
        return (f"compiled by torch {artifacts.get('torch')}, this process runs torch "
                f"{torch.__version__}")
    if not isinstance(artifacts.get("cache"), bytes) or \
            not isinstance(artifacts.get("binaries"), dict):
        return "incomplete compiled artefacts"
    for rel, entry in artifacts["binaries"].items():
        if not (isinstance(rel, str) and isinstance(entry, tuple) and len(entry) == 2
                and isinstance(entry[1], bytes)
                and hashlib.sha256(entry[1]).hexdigest() == entry[0]):
            return f"kernel binary {rel!r} is damaged (checksum mismatch)"
        if os.path.isabs(rel) or ".." in rel.split(os.sep):
            return f"kernel binary path {rel!r} leaves the cache folder"
    return None


def install(artifacts: dict) -> bool:
    """Put checked ``artifacts`` (see :py:func:`check`) into this process's compiler
    caches. Returns False (and logs why) when torch refused them."""
    info = torch.compiler.load_cache_artifacts(artifacts["cache"])
    if info is None:
        logger.warning("torch could not read the compiled program's cache entries; "
                       "compiling again.")
        return False
    root = _inductor_cache_dir()
    if root is None:
        return True
    for rel, (_, data) in artifacts["binaries"].items():
        path = os.path.join(root, rel)
        if os.path.exists(path):
            continue
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    return True


@contextlib.contextmanager
def prebuilt_kernels() -> Iterator[None]:
    """Around the first call after :py:func:`install`: skip building inductor's
    precompiled C++ header, which is only needed to compile kernels and costs tens of
    seconds on a fresh machine. A kernel that still has to be built (none when the
    binaries were installed) includes the plain header instead: slower, same code."""
    try:
        codecache = inductor_codecache()
        original = codecache._precompile_header
    except (ImportError, AttributeError):
        yield
        return
    folder = os.path.join(tempfile.gettempdir(), f"poptorch-headers-{os.getuid()}")

    def plain_header(header: str, *args: object, **kwargs: object) -> str:
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, hashlib.sha256(header.encode()).hexdigest()[:24] + ".h")
        if not os.path.exists(path):
            with open(path, "w", encoding="utf-8") as f:
                f.write(f"#include <{header}>\n")
        return path

    codecache._precompile_header = plain_header  # (its lru_cache wrapper is what we replace)
    try:
        yield
    finally:
        codecache._precompile_header = original
