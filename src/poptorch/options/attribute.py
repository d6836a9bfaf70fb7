"""``poptorch.Attribute``: PopART attributes for the ops of a scope (recorded only)."""
from __future__ import annotations

from types import TracebackType

from .. import _logging

# (recorded only: the values are the user's, never read)
_attribute_stack: list[dict[str, object]] = []


class Attribute:
    """Context manager attaching PopART-style attributes to the ops created inside it::

        with poptorch.Attribute(__outline={"layer": "embedding"}):
            ...

    PopART attributes have no meaning on our devices: they are recorded (see
    :py:func:`current_attributes`) and reported once at INFO.
    """

    def __init__(self, **kwargs: object) -> None:
        self.attributes = kwargs

    def __enter__(self) -> Attribute:
        _logging.info_once(("Attribute", tuple(sorted(self.attributes))),
                           "poptorch.Attribute(%s) is recorded only: PopART attributes "
                           "have no meaning on this device.",
                           ", ".join(sorted(self.attributes)))
        _attribute_stack.append(self.attributes)
        return self

    def __exit__(self, type: type[BaseException] | None, value: BaseException | None,  # pylint: disable=redefined-builtin
                 traceback: TracebackType | None) -> None:
        _attribute_stack.pop()


def current_attributes() -> dict[str, object]:
    """The attributes of the enclosing ``poptorch.Attribute`` blocks (inner wins)."""
    merged: dict[str, object] = {}
    for attributes in _attribute_stack:
        merged.update(attributes)
    return merged
