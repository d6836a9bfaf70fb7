"""The host heap as the memory of CPU IPUs: freed memory is kept for the next step.

An IPU's memory is allocated once, when its program is loaded, so the second step of a
PopTorch program costs what every later one does. On the CPU the activations and
gradients of a step live in the process heap, and glibc's ``malloc`` gives memory back
to the kernel as soon as it can: a block above ``M_MMAP_THRESHOLD`` (128 KiB at first,
raised by glibc as blocks are freed) is a fresh ``mmap`` each time, and once more than
``M_TRIM_THRESHOLD`` is free at the top of the heap it is trimmed. A step that frees its
activations together then takes its pages back from the kernel at the next step, one
page fault per 4 KiB: 700 to 1,100 faults per step for the benchmark CNN's compiled
training step, which made it anything from 0.9x to 1.3x the eager loop depending on how
the heap happened to be laid out in the process (``benchmarks/bench_compiled.py``).

So when the first model is compiled for the CPU, :py:func:`keep_freed_memory` sets
glibc's thresholds (``mallopt``) the way its dynamic adjustment ends up on a long run:
blocks up to 32 MiB (glibc's own ceiling for that adjustment) come from the heap, and up
to 256 MiB of free heap is kept for reuse instead of being returned after every step.
The process's memory then stays at its peak between steps, as an IPU's does. One INFO
line says so; ``POPTORCH_HOST_HEAP=system`` leaves ``malloc`` as it is, and so does a
process started with glibc's own settings (``MALLOC_MMAP_THRESHOLD_``,
``MALLOC_TRIM_THRESHOLD_``, ... or ``glibc.malloc`` tunables in ``GLIBC_TUNABLES``: the
memory benchmarks set them so that peak RSS follows live memory). Nothing is done where
the allocator is not glibc's (musl, macOS, or jemalloc / tcmalloc preloaded, which keep
freed memory themselves).
"""
from __future__ import annotations

import ctypes
import os

from ..._logging import info_once, logger
from ...errors import Error

__all__ = ["MMAP_THRESHOLD", "TRIM_THRESHOLD", "keep_freed_memory"]

MMAP_THRESHOLD = 32 << 20
"""Blocks up to this size come from the heap (glibc's ``DEFAULT_MMAP_THRESHOLD_MAX`` on
64-bit systems: the most its dynamic threshold reaches, and the most ``mallopt``
accepts)."""

TRIM_THRESHOLD = 256 << 20
"""Free memory at the top of the heap kept for reuse before glibc returns it."""

_M_TRIM_THRESHOLD = -1  # glibc's malloc.h
_M_MMAP_THRESHOLD = -3

_CHOICES = ("keep", "system")
_MALLOC_ENVIRONMENT = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_",
                       "MALLOC_MMAP_MAX_")
_done = False


def _chosen_by_environment() -> str | None:
    """The environment variable that gave glibc's malloc its settings, if one did."""
    for name in _MALLOC_ENVIRONMENT:
        if name in os.environ:
            return name
    if "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""):
        return "GLIBC_TUNABLES"
    return None


def _glibc_malloc() -> ctypes.CDLL | None:
    """glibc, when it is the allocator ``malloc`` resolves to in this process."""
    try:
        process = ctypes.CDLL(None)
        libc = ctypes.CDLL("libc.so.6")
        libc.gnu_get_libc_version  # noqa: B018  (raises AttributeError off glibc)
    except (OSError, AttributeError):
        return None
    malloc = ctypes.cast(process.malloc, ctypes.c_void_p).value
    if malloc != ctypes.cast(libc.malloc, ctypes.c_void_p).value:
        return None  # another allocator (jemalloc, tcmalloc) is preloaded
    return libc


def keep_freed_memory() -> bool:
    """Keep the memory a step frees for the next one (module docstring); once per
    process. Returns whether glibc's thresholds were set by this call."""
    global _done
    if _done:
        return False
    choice = os.environ.get("POPTORCH_HOST_HEAP", "keep").strip().lower() or "keep"
    if choice not in _CHOICES:
        raise Error(f"POPTORCH_HOST_HEAP={os.environ['POPTORCH_HOST_HEAP']!r} is not one "
                    f"of {', '.join(_CHOICES)}: 'keep' (the default) keeps memory freed by "
                    "a step for the next one, 'system' leaves malloc's settings alone.")
    _done = True
    chosen = "POPTORCH_HOST_HEAP=system" if choice == "system" else \
        _chosen_by_environment()
    if chosen is not None:
        info_once("host-heap", "Host memory: malloc's settings are left as they are "
                  "(%s%s).", chosen, " is set" if "=" not in chosen else "")
        return False
    libc = _glibc_malloc()
    if libc is None:
        logger.debug("Host memory: the allocator is not glibc's malloc; left as it is.")
        return False
    ok = libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and \
        libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    if not ok:
        logger.debug("Host memory: glibc refused the malloc thresholds; left as they are.")
        return False
    info_once("host-heap", "Host memory: blocks up to %d MiB come from the heap and up to "
              "%d MiB of freed memory is kept for the next step, as an IPU keeps its "
              "memory (POPTORCH_HOST_HEAP=system leaves malloc as it is).",
              MMAP_THRESHOLD >> 20, TRIM_THRESHOLD >> 20)
    return True
