"""Stand-in for upstream's C++ extension module ``poptorch.poptorch_core``.

Programs import the exception types (``from poptorch.poptorch_core import Error``) and
``importPoptorchMetadataFromFile`` from here; they are the same objects as
``poptorch.Error`` and friends.
"""
from ._runtime.export import importPoptorchMetadataFromFile
from .errors import Error, RecoverableError, UnrecoverableError

__all__ = ["Error", "RecoverableError", "UnrecoverableError",
           "importPoptorchMetadataFromFile"]
