"""The value store behind every options object.

An :py:class:`OptionsDict` keeps option values in a dictionary, exposes them as read-only
attributes (``opts.device_iterations``) and can be frozen: once a model has been compiled
with a set of options, changing them would silently not apply, so every setter raises.
Setters of the concrete option classes live in the modules of this folder; they validate and then
store through :py:meth:`OptionsDict.set` / :py:meth:`OptionsDict.createOrSet`.
"""
from __future__ import annotations

import copy
import enum
import os
from collections.abc import Iterable
from typing import ClassVar

from .._typing import OptionValue
from ..errors import (
    Error,
    PoptorchAssertionError,
    PoptorchAttributeError,
    PoptorchTypeError,
    PoptorchValueError,
)

__all__ = ["OptionChoiceError", "OptionNameError", "OptionValueError",
           "OptionsDict", "OptionsFrozenError", "check_bool", "check_enum", "check_int",
           "check_optional_path", "check_str", "check_str_list", "check_truth"]

class OptionValueError(PoptorchAssertionError):
    """A value an option setter refuses: a ``poptorch.Error`` that is also the
    ``AssertionError`` PopTorch's setters raise for a value of the wrong type or range
    (their ``assert isinstance(...)`` checks)."""


class OptionChoiceError(PoptorchValueError):
    """A refused choice: a ``poptorch.Error`` that is also the ``ValueError`` PopTorch
    raises for it (reduction types, partials types, input replica groups, ...)."""


class OptionNameError(PoptorchTypeError):
    """A refused argument type: a ``poptorch.Error`` that is also the ``TypeError``
    PopTorch's setter meets for it (an environment variable name that is no string)."""


class OptionsFrozenError(PoptorchAttributeError):
    """A change to frozen options: a ``poptorch.Error`` that is also the
    ``AttributeError`` PopTorch raises for it."""


_FROZEN_MESSAGE = ("Options are frozen: a model or a poptorch.DataLoader uses them, so changing "
                   "{what} would not take effect. Use opts.clone() to get an unfrozen copy, "
                   "change the copy and wrap a new model with it.")


class OptionsDict:
    """A dictionary of option values with attribute access and freezing.

    Args:
        default_values: the options this object starts with and their initial values.
    """

    def __init__(self, **default_values: OptionValue) -> None:
        object.__setattr__(self, "_values", dict(default_values))
        object.__setattr__(self, "_defaults", copy.deepcopy(default_values))
        object.__setattr__(self, "_frozen", False)

    # -- reading -------------------------------------------------------------------
    def __call__(self, option: str) -> OptionValue:
        """Value of ``option`` (``opts("device_iterations")``)."""
        if not self.exists(option):
            raise AttributeError(f"{type(self).__name__} has no option '{option}'; "
                                 f"options: {sorted(self._values)}")
        return self._values[option]

    def __getattr__(self, option: str) -> OptionValue:
        # Only reached when normal lookup fails: methods and properties win.
        values = self.__dict__.get("_values")
        if values is not None and option in values:
            return values[option]
        raise AttributeError(f"'{type(self).__name__}' object has no attribute or option "
                             f"'{option}'")

    # Options that may also be assigned (``opts.replication_factor = 4``, as PopTorch
    # allows): option name -> the setter that validates and stores the value.
    _ASSIGNMENT_SETTERS: ClassVar[dict[str, str]] = {}

    def __setattr__(self, name: str, value: object) -> None:
        # ``opts.device_iterations = 4`` must not bypass validation by shadowing the value:
        # it goes through the option's setter, or is refused when there is no such setter.
        if not name.startswith("_"):
            setter = self._ASSIGNMENT_SETTERS.get(name)
            if setter is not None:
                getattr(self, setter)(value)
                return
            if name in self.__dict__.get("_values", {}):
                raise AttributeError(f"Option '{name}' is read-only: call its setter method "
                                     f"(see the Options documentation) instead of "
                                     f"assigning it.")
        object.__setattr__(self, name, value)

    def exists(self, option: str) -> bool:
        """True if ``option`` has a value (some options only exist once set)."""
        return option in self._values

    def toDict(self) -> dict[str, OptionValue]:
        """A copy of all the option values of this object."""
        return copy.deepcopy(self._values)

    # -- writing -------------------------------------------------------------------
    def checkIsFrozen(self, option: str | None = None) -> None:
        """Raise :py:class:`poptorch.Error` if these options can no longer change."""
        if self._frozen:
            what = f"option '{option}'" if option else "them"
            raise OptionsFrozenError(_FROZEN_MESSAGE.format(what=what))

    def set(self, **kwargs: OptionValue) -> OptionsDict:
        """Change existing options (an unknown name is an error)."""
        for option, value in kwargs.items():
            self.checkIsFrozen(option)
            if option not in self._values:
                raise OptionValueError(f"Unknown option '{option}' for "
                                       f"{type(self).__name__}; options: "
                                       f"{sorted(self._values)}")
            self._values[option] = value
        return self

    def createOrSet(self, **kwargs: OptionValue) -> OptionsDict:
        """Change options, creating those that do not exist yet."""
        for option, value in kwargs.items():
            self.checkIsFrozen(option)
            self._values[option] = value
        return self

    def deleteIfExists(self, option: str) -> OptionsDict:
        """Remove ``option`` if it has a value."""
        self.checkIsFrozen(option)
        self._values.pop(option, None)
        return self

    def update(self, other: OptionsDict | dict[str, OptionValue]) -> OptionsDict:
        """Set (or create) every option of ``other`` (a dict or another OptionsDict)."""
        items = other.toDict() if isinstance(other, OptionsDict) else dict(other)
        return self.createOrSet(**items)

    # -- freezing, copying, printing ----------------------------------------------
    def _freeze(self) -> None:
        """Forbid any further change (called when a model is compiled with these)."""
        object.__setattr__(self, "_frozen", True)

    def _is_frozen(self) -> bool:
        return self._frozen

    def _ignored(self) -> dict[str, OptionValue]:
        """Options set here that have no meaning on our devices (none by default)."""
        return {}

    def _changed_from_default(self, option: str) -> bool:
        """True if ``option`` was set to something other than its initial value."""
        if option not in self._values:
            return False
        if option not in self._defaults:
            return True
        return self._values[option] != self._defaults[option]

    def __deepcopy__(self, memo: dict) -> OptionsDict:
        clone = type(self).__new__(type(self))
        memo[id(self)] = clone
        for key, value in self.__dict__.items():
            object.__setattr__(clone, key, copy.deepcopy(value, memo))
        return clone

    def __getstate__(self) -> dict:
        return dict(self.__dict__)

    def __setstate__(self, state: dict) -> None:
        for key, value in state.items():
            object.__setattr__(self, key, value)

    def __repr__(self) -> str:
        body = ", ".join(f"{k}={_short_repr(v)}" for k, v in sorted(self._values.items()))
        return f"{type(self).__name__}({body})"


def _short_repr(value: object) -> str:
    if isinstance(value, enum.Enum):
        return f"{type(value).__name__}.{value.name}"
    return repr(value)


# -- validation helpers shared by the setters ------------------------------------------
# Each raises ``error`` (default: OptionValueError, a poptorch.Error that is also the
# AssertionError PopTorch's setters raise) with a message naming the option.
ErrorType = type[Error]


def check_bool(option: str, value: object, error: ErrorType = OptionValueError) -> bool:
    """``value`` if it is a bool, else a clear error naming ``option``."""
    if not isinstance(value, bool):
        raise error(f"{option}: expected True or False, got {value!r} "
                    f"({type(value).__name__}).")
    return value


def check_truth(option: str, value: object) -> bool:
    """The truth value of ``value``, for the setters PopTorch reads that way (any
    object: ``enableSyntheticData(2)`` is True, ``showCompilationProgressBar(None)``
    is False). An object without a single truth value (a tensor or array of several
    elements) is an error."""
    try:
        return bool(value)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise OptionValueError(f"{option}: {value!r} has no single truth value "
                               f"({exc}); pass True or False.") from None


def check_int(option: str, value: object, minimum: int | None = None,
              maximum: int | None = None, error: ErrorType = OptionValueError) -> int:
    """``value`` if it is an int (not a bool) in [minimum, maximum]."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise error(f"{option}: expected an integer, got {value!r} "
                    f"({type(value).__name__}).")
    if minimum is not None and value < minimum:
        raise error(f"{option}: must be >= {minimum}, got {value}.")
    if maximum is not None and value > maximum:
        raise error(f"{option}: must be <= {maximum}, got {value}.")
    return value


def check_str(option: str, value: object, error: ErrorType = OptionValueError) -> str:
    """``value`` if it is a str."""
    if not isinstance(value, str):
        raise error(f"{option}: expected a string, got {value!r} ({type(value).__name__}).")
    return value


def check_enum(option: str, value: object, enum_type: type[enum.Enum],
               accepted: Iterable[enum.Enum] | None = None,
               error: ErrorType = OptionValueError) -> enum.Enum:
    """Convert ``value`` to a member of ``enum_type``.

    Accepts a member, its name (``"All"``, ``"OutputMode.All"``) or its value (``2``),
    which is what config files and JSON can express. ``accepted`` restricts the
    allowed members.
    """
    allowed = list(accepted) if accepted is not None else list(enum_type)
    names = ", ".join(f"{enum_type.__name__}.{m.name}" for m in allowed)
    member = None
    if isinstance(value, enum_type):
        member = value
    elif isinstance(value, str) and value in enum_type.__members__:
        member = enum_type[value]
    elif isinstance(value, str) and value.startswith(enum_type.__name__ + ".") and \
            value.split(".", 1)[1] in enum_type.__members__:
        member = enum_type[value.split(".", 1)[1]]  # "ConnectionType.OnDemand"
    elif not isinstance(value, (bool, enum.Enum)):
        try:
            member = enum_type(value)
        except (ValueError, TypeError):
            member = None
    if member is None or member not in allowed:
        raise error(f"{option}: expected one of {names}, got {value!r}.")
    return member


def check_optional_path(option: str, value: object) -> str | None:
    """``value`` as a path string (None stays None)."""
    if value is None:
        return None
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    return check_str(option, value)


def check_str_list(option: str, value: object) -> list[str]:
    """``value`` as a list of strings: a list, a tuple or a set (sorted) of them."""
    if isinstance(value, (set, frozenset)):
        value = sorted(value, key=str)
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise OptionValueError(f"{option}: expected a list of strings, got {value!r}.")
    for item in value:
        check_str(option, item)
    return list(value)
