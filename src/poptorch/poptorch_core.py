"""Stand-in for upstream's C++ extension module ``poptorch.poptorch_core``.

Programs import the exception types from here (``from poptorch.poptorch_core import
Error``); they are the same objects as ``poptorch.Error`` and friends.
"""
from .errors import Error, RecoverableError, UnrecoverableError

__all__ = ["Error", "RecoverableError", "UnrecoverableError"]
