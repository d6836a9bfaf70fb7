"""Custom argument parsers: let the executor split and rebuild user-defined input types.

The executor batches inputs with ``torch.utils._pytree``; :func:`registerCustomArgParser`
registers the type as a pytree node whose children are the tensors the parser yields,
so ``tree_flatten``/``tree_unflatten`` take such objects apart and rebuild them.
"""
from __future__ import annotations

import abc
import copy
import importlib.util
from typing import Any, Iterator, Optional

import torch
from .._runtime.torch_internals import pytree

from .._logging import info_once

__all__ = ["ICustomArgParser", "registerCustomArgParser", "registerGeometricCustomArgParsers"]

_parsers: dict[type, "ICustomArgParser"] = {}


class ICustomArgParser(abc.ABC):
    """Interface to extract the tensors of a custom object and rebuild the object."""

    @abc.abstractmethod
    def yieldTensors(self, struct) -> Iterator[torch.Tensor]:
        """Yield every tensor contained in ``struct`` in a deterministic order."""

    @abc.abstractmethod
    def reconstruct(self, original_structure, tensor_iterator: Iterator[torch.Tensor]):
        """Build a new object like ``original_structure`` taking its tensors from
        ``tensor_iterator``, in the order of :meth:`yieldTensors`."""


def _flatten(parser: ICustomArgParser, struct) -> tuple[list, Any]:
    return list(parser.yieldTensors(struct)), struct


def _unflatten(parser: ICustomArgParser, values, original) -> Any:
    return parser.reconstruct(original, iter(list(values)))


def registerCustomArgParser(arg_data_type: type,
                            arg_parser: Optional[ICustomArgParser]) -> None:
    """Use ``arg_parser`` for arguments of type ``arg_data_type``.

    A parser already registered for the type is replaced; ``arg_parser=None`` removes it.
    """
    if not isinstance(arg_data_type, type):
        raise TypeError(f"registerCustomArgParser: arg_data_type must be a class, got "
                        f"{arg_data_type!r}.")
    if arg_parser is not None and not isinstance(arg_parser, ICustomArgParser):
        raise TypeError("registerCustomArgParser: arg_parser must be an instance of "
                        f"poptorch.ICustomArgParser or None, got {type(arg_parser).__name__}.")
    if arg_data_type in _parsers:
        pytree._deregister_pytree_node(arg_data_type)
        del _parsers[arg_data_type]
    elif arg_data_type in pytree.SUPPORTED_NODES:
        raise TypeError(f"registerCustomArgParser: {arg_data_type.__name__} is already a "
                        "pytree node type (registered outside poptorch); it cannot get a "
                        "custom argument parser.")
    if arg_parser is None:
        return
    pytree.register_pytree_node(
        arg_data_type,
        lambda struct: _flatten(arg_parser, struct),
        lambda values, original: _unflatten(arg_parser, values, original),
        serialized_type_name=f"poptorch.custom_arg.{arg_data_type.__module__}."
                             f"{arg_data_type.__qualname__}")
    _parsers[arg_data_type] = arg_parser


class _GeometricDataParser(ICustomArgParser):
    """Parser for ``torch_geometric`` ``Data``/``Batch``/``HeteroData``: their tensor
    attributes, in sorted key order (per node/edge store for heterogeneous graphs)."""

    @staticmethod
    def _tensor_slots(struct) -> list[tuple[Any, str]]:
        slots: list = []
        for store in struct.stores:
            slots.extend((store, key) for key in sorted(store.keys())
                         if isinstance(store[key], torch.Tensor))
        return slots

    def yieldTensors(self, struct) -> Iterator[torch.Tensor]:
        for store, key in self._tensor_slots(struct):
            yield store[key]

    def reconstruct(self, original_structure, tensor_iterator):
        rebuilt = copy.copy(original_structure)
        for store, key in self._tensor_slots(rebuilt):
            store[key] = next(tensor_iterator)
        return rebuilt


def registerGeometricCustomArgParsers() -> None:
    """Register parsers for ``torch_geometric.data.Data``, ``Batch`` and ``HeteroData``.

    Without ``torch_geometric`` installed there is nothing to register: the call logs
    that at INFO and returns.
    """
    if importlib.util.find_spec("torch_geometric") is None:
        info_once("registerGeometricCustomArgParsers",
                  "registerGeometricCustomArgParsers: torch_geometric is not installed; "
                  "no parsers registered.")
        return
    from torch_geometric.data import Batch, Data, HeteroData  # noqa: PLC0415 (optional)
    parser = _GeometricDataParser()
    for data_type in (Data, HeteroData, Batch):
        registerCustomArgParser(data_type, parser)
