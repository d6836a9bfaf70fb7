"""The warning for optimizers subclassed from a torch.optim or poptorch.optim optimizer.

On the IPU, PopTorch replaced the optimizer by PopART's native one of the same kind, so
the methods a subclass overrides (``step()``, ...) never ran, and PopTorch warned about
it. Here the optimizer's own Python code runs as written: a subclass behaves as it does
in a plain PyTorch loop. The warning stays (WARN level, once per class) because code
ported from the IPU may have relied on the override being ignored; its text says both.
"""
from __future__ import annotations

import logging
import weakref

import torch

from .._logging import logger
from .base import Optimizer

__all__ = ["library_base", "warn_if_subclassed"]

# the abstract bases: deriving from them directly is writing a new optimizer, not
# subclassing an existing one
_ABSTRACT = (torch.optim.Optimizer, Optimizer, object)
_LIBRARY_MODULES = ("torch.optim.", "poptorch.optim.")
# classes already warned about (weak: a test's throw-away classes may be collected)
_warned: weakref.WeakSet[type] = weakref.WeakSet()


def _is_library_class(cls: type) -> bool:
    return cls.__module__.startswith(_LIBRARY_MODULES)


def library_base(optimizer: object) -> type | None:
    """The torch.optim / poptorch.optim optimizer class ``optimizer``'s class derives
    from, when that class is a user's subclass of it; None for a library class itself
    and for a new optimizer derived straight from ``torch.optim.Optimizer``."""
    cls = type(optimizer)
    if _is_library_class(cls):
        return None
    for base in cls.__mro__[1:]:
        if base not in _ABSTRACT and _is_library_class(base):
            return base
    return None


def warn_if_subclassed(optimizer: object) -> bool:
    """Warn (once per class) when ``optimizer`` is a subclass of a library optimizer.

    Returns True when the warning was given by this call.
    """
    base = library_base(optimizer)
    cls = type(optimizer)
    if base is None or cls in _warned:
        return False
    _warned.add(cls)
    library = "poptorch.optim" if base.__module__.startswith("poptorch.") else "torch.optim"
    logger.log(
        logging.WARNING,
        "Optimizer `%s` subclasses %s.%s. Poptorch does not run Python optimizer code "
        "directly on the IPU (PopART's native %s replaced it there, so overridden "
        "methods were ignored); here the subclass's own code, step() included, runs as "
        "written, so results can differ from those of an IPU run.",
        cls.__name__, library, base.__name__, base.__name__)
    return True
