"""PyG's API as PopTorch Geometric 3.4's programs use it, where PyG changed it since.

PyG 2.4 turned ``BaseData.keys`` (``Data``, ``HeteroData``, their batches) from a
property into a method: programs written for PopTorch Geometric 3.4 read ``data.keys``,
programs for PyG 2.8 call ``data.keys()``. With poptorch_geometric imported, ``keys``
is a list of the keys that can also be called (returning the same keys as a new list),
so both kinds of program run; ``install()`` / ``uninstall()`` put it in place and take
it out.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch_geometric.data.data import BaseData

__all__ = ["GraphKeys", "install", "uninstall"]


class GraphKeys(list):
    """The keys of a graph: a list, and callable like PyG's ``keys()`` method."""

    def __call__(self) -> list[str]:
        return list(self)


class _KeysAttribute:
    """``BaseData.keys``: on a graph, its :class:`GraphKeys`; on the class, PyG's
    method (``BaseData.keys(data)`` keeps working)."""

    def __init__(self, method: Callable[[Any], list[str]]) -> None:
        self.method = method

    def __get__(self, instance: Any, owner: type | None = None) -> Any:
        if instance is None:
            return self.method
        return GraphKeys(self.method(instance))


def install() -> None:
    """Make ``data.keys`` work both as PyG 2.8's method and as the older property."""
    current = BaseData.__dict__.get("keys")
    if current is not None and not isinstance(current, _KeysAttribute):
        BaseData.keys = _KeysAttribute(current)


def uninstall() -> None:
    """Give ``BaseData`` its own ``keys`` method back."""
    current = BaseData.__dict__.get("keys")
    if isinstance(current, _KeysAttribute):
        BaseData.keys = current.method
