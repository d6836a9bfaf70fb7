"""PopTorch's exception types.

``Error`` is raised for problems the library finds in user input or configuration.
``RecoverableError`` and ``UnrecoverableError`` are raised for device faults (on our
devices: CUDA errors and out-of-memory), as PopTorch raises them for IPU faults.

Where upstream PopTorch 3.4 refuses something with a built-in exception (an ``assert``,
a ``ValueError``, ...), we raise one of the classes below: each is a ``poptorch.Error``
*and* the built-in class upstream raised, so both ``except poptorch.Error`` and code
written against upstream (``except AssertionError``) catch it. The message stays ours
(what was wrong and how to fix it).

* ``PoptorchAssertionError``: also an ``AssertionError`` (upstream's ``assert``);
* ``PoptorchValueError``: also a ``ValueError``;
* ``PoptorchTypeError``: also a ``TypeError``;
* ``PoptorchRuntimeError``: also a ``RuntimeError``;
* ``PoptorchAttributeError``: also an ``AttributeError``.
"""
from __future__ import annotations

import inspect
import os

__all__ = [
    "ConfigFileError",
    "Error",
    "PoptorchAssertionError",
    "PoptorchAttributeError",
    "PoptorchRuntimeError",
    "PoptorchTypeError",
    "PoptorchValueError",
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


class PoptorchAssertionError(Error, AssertionError):
    """A refusal that upstream PopTorch makes with an ``assert``: a ``poptorch.Error``
    that is also an ``AssertionError`` (a batch size that does not fit the options, a
    bad ``DataLoader`` argument, an accumulation type, ...)."""


class PoptorchValueError(Error, ValueError):
    """A refusal that upstream PopTorch raises as ``ValueError``: a ``poptorch.Error``
    that is also a ``ValueError``."""


class PoptorchTypeError(Error, TypeError):
    """A refusal that upstream PopTorch raises as ``TypeError``: a ``poptorch.Error``
    that is also a ``TypeError``."""


class PoptorchRuntimeError(Error, RuntimeError):
    """A refusal that upstream PopTorch raises as ``RuntimeError`` (for example loading
    an empty optimizer state, wrapping a model twice): a ``poptorch.Error`` that is also
    a ``RuntimeError``."""


class PoptorchAttributeError(Error, AttributeError):
    """A refusal that upstream PopTorch raises as ``AttributeError`` (a change to frozen
    options): a ``poptorch.Error`` that is also an ``AttributeError``."""


class ConfigFileError(Exception):
    """A line of an options file (``Options.loadFromFile``) could not be applied."""


def createPoptorchError(msg: str) -> Error:
    """Build (not raise) a :py:class:`Error` carrying ``msg``."""
    return Error(msg)
