"""PopTorch's exception types.

``Error`` is raised for problems the library finds in user input or configuration.
``RecoverableError`` and ``UnrecoverableError`` are raised for device faults (on our
devices: CUDA errors and out-of-memory), as PopTorch raises them for IPU faults.
"""
from __future__ import annotations

import inspect
import os

__all__ = [
    "ConfigFileError",
    "Error",
    "RecoverableError",
    "UnrecoverableError",
    "createPoptorchError",
]

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def _user_location() -> str:
    """``file:line`` of the innermost stack frame outside this package."""
    for frame in inspect.stack(context=0)[2:]:
        if not os.path.abspath(frame.filename).startswith(_PACKAGE_DIR):
            return f"{frame.filename}:{frame.lineno}"
    return ""


class Error(Exception):
    """An error PopTorch detected.

    Attributes:
        message: what went wrong and how to fix it.
        type: the kind of error ("poptorch_error", "recoverable_runtime_error", ...).
        location: where in the user's program it was raised (``file:line``).
    """
    default_type = "poptorch_error"

    def __init__(self, message: str = "", *, type: str | None = None,
                 location: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.type = type or self.default_type
        self.location = _user_location() if location is None else location


class RecoverableError(Error):
    """A device fault after which the program may go on once ``recovery_action``
    has been taken (for example "IPU_RESET": free memory and run again)."""
    default_type = "recoverable_runtime_error"

    def __init__(self, message: str = "", *, recovery_action: str = "IPU_RESET",
                 type: str | None = None, location: str | None = None) -> None:
        super().__init__(message, type=type, location=location)
        self.recovery_action = recovery_action


class UnrecoverableError(Error):
    """A device fault after which the device cannot be used again in this process."""
    default_type = "unrecoverable_runtime_error"


class ConfigFileError(Exception):
    """A line of an options file (``Options.loadFromFile``) could not be applied."""


def createPoptorchError(msg: str) -> Error:
    """Build (not raise) a :py:class:`Error` carrying ``msg``."""
    return Error(msg)
