"""An object's own attributes, read without reaching into its ``__dict__``.

Several places need to know whether a module carries an instance-level ``forward`` (a
wrapped forward: autocast scopes, a user's patch), which attributes an optimizer has of
its own, or whether a class defines a method itself. ``inspect.getattr_static`` answers
that the way attribute lookup does (instance first, then the class), without calling
descriptors and without treating an object's ``__dict__`` as a mapping we may edit.
"""
from __future__ import annotations

import inspect
from typing import Any

__all__ = ["attribute_table", "defines", "own_attribute", "own_attribute_names"]

_MISSING = object()


def own_attribute(obj: object, name: str, default: object = None) -> Any:  # (whatever is stored)
    """``obj``'s attribute ``name`` when it is stored on ``obj`` itself (not found
    through its class), else ``default``."""
    value = inspect.getattr_static(obj, name, _MISSING)
    if value is _MISSING or value is inspect.getattr_static(type(obj), name, _MISSING):
        return default
    return value


def attribute_table(obj: object) -> dict[str, Any]:  # (whatever is stored)
    """A copy of the attributes stored on ``obj`` itself, by name: what copying an
    object or scanning its plain attributes reads. The one place that reads an
    instance's attribute table (``tests/test_call_path_structure.py``)."""
    return dict(vars(obj))


def own_attribute_names(obj: object) -> set[str]:
    """The names of the attributes stored on ``obj`` itself."""
    return {name for name in dir(obj) if own_attribute(obj, name, _MISSING) is not _MISSING}


def defines(cls: type, name: str) -> bool:
    """Whether class ``cls`` defines ``name`` itself (not only a base class)."""
    value = inspect.getattr_static(cls, name, _MISSING)
    return value is not _MISSING and all(
        inspect.getattr_static(base, name, _MISSING) is not value for base in cls.__mro__[1:])
