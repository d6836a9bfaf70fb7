"""Custom argument parsers: let the executor split and rebuild user-defined input types.

The executor batches inputs with ``torch.utils._pytree``; :func:`registerCustomArgParser`
registers the type as a pytree node whose children are the tensors the parser yields,
so ``tree_flatten``/``tree_unflatten`` take such objects apart and rebuild them.
"""
from __future__ import annotations

import abc
import importlib.util
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from .._logging import info_once
from .._runtime.torch_internals import pytree

__all__ = ["ICustomArgParser", "registerCustomArgParser", "registerGeometricCustomArgParsers"]

_parsers: dict[type, ICustomArgParser] = {}


class ICustomArgParser(abc.ABC):
    """Interface to extract the tensors of a custom object and rebuild the object."""

    @abc.abstractmethod
    def yieldTensors(self, struct: Any) -> Iterator[torch.Tensor]:
        """Yield every tensor contained in ``struct`` in a deterministic order."""

    @abc.abstractmethod
    def reconstruct(self, original_structure: Any,
                    tensor_iterator: Iterator[torch.Tensor]) -> Any:
        """Build a new object like ``original_structure`` taking its tensors from
        ``tensor_iterator``, in the order of :meth:`yieldTensors`."""


def _flatten(parser: ICustomArgParser, struct: Any) -> tuple[list[torch.Tensor], Any]:
    return list(parser.yieldTensors(struct)), struct


def _unflatten(parser: ICustomArgParser, values: Iterable[torch.Tensor], original: Any) -> Any:
    return parser.reconstruct(original, iter(list(values)))


def registerCustomArgParser(arg_data_type: type,
                            arg_parser: ICustomArgParser | None) -> None:
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


def registerGeometricCustomArgParsers() -> None:
    """Register the parsers of ``torch_geometric``'s ``Data``, ``HeteroData`` and their
    batch classes (``poptorch_geometric.PyGArgsParser``; importing
    ``poptorch_geometric`` registers them too).

    Without ``torch_geometric`` installed there is nothing to register: the call logs
    that at INFO and returns.
    """
    if importlib.util.find_spec("torch_geometric") is None:
        info_once("registerGeometricCustomArgParsers",
                  "registerGeometricCustomArgParsers: torch_geometric is not installed; "
                  "no parsers registered.")
        return
    # poptorch_geometric is the layer above poptorch: imported on request only
    types = importlib.import_module("poptorch_geometric.types")
    types.registerCustomArgParsers()
