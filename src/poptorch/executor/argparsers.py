"""Custom argument parsers: let the executor split and rebuild user-defined input types.

The executor batches inputs with ``torch.utils._pytree``; :func:`registerCustomArgParser`
registers the type as a pytree node whose children are the tensors the parser yields,
so ``tree_flatten``/``tree_unflatten`` take such objects apart and rebuild them.

Add-ons bring parsers for other libraries' types and register them when imported
(``poptorch_geometric`` for PyG's graphs): the core never imports an add-on; an add-on
tells it about itself with :func:`registerArgParserAddOn`.
"""
from __future__ import annotations

import abc
import importlib.util
from collections.abc import Callable, Iterable, Iterator
from typing import Generic, TypeVar

import torch

from .._logging import info_once
from .._runtime.torch_internals import pytree
from ..errors import PoptorchTypeError

__all__ = ["ICustomArgParser", "registerArgParserAddOn", "registerCustomArgParser",
           "registerGeometricCustomArgParsers"]

# the user's argument type a parser takes apart and rebuilds
ArgT = TypeVar("ArgT")

# registered type -> its parser (of that type)
_parsers: dict[type, object] = {}
# library whose types an add-on parses -> the add-on's registration (see
# registerArgParserAddOn)
_addons: dict[str, Callable[[], None]] = {}


class ICustomArgParser(abc.ABC, Generic[ArgT]):
    """Interface to extract the tensors of a custom object and rebuild the object
    (``ICustomArgParser[T]``: a parser of ``T`` objects)."""

    @abc.abstractmethod
    def yieldTensors(self, struct: ArgT) -> Iterator[torch.Tensor]:
        """Yield every tensor contained in ``struct`` in a deterministic order."""

    @abc.abstractmethod
    def reconstruct(self, original_structure: ArgT,
                    tensor_iterator: Iterator[torch.Tensor]) -> ArgT:
        """Build a new object like ``original_structure`` taking its tensors from
        ``tensor_iterator``, in the order of :meth:`yieldTensors`."""


def _flatten(parser: ICustomArgParser[ArgT], struct: ArgT) -> tuple[list[torch.Tensor], ArgT]:
    return list(parser.yieldTensors(struct)), struct


def _unflatten(parser: ICustomArgParser[ArgT], values: Iterable[torch.Tensor],
               original: ArgT) -> ArgT:
    return parser.reconstruct(original, iter(list(values)))


def registerCustomArgParser(arg_data_type: type[ArgT],
                            arg_parser: ICustomArgParser[ArgT] | None) -> None:
    """Use ``arg_parser`` for arguments of type ``arg_data_type``.

    A parser already registered for the type is replaced; ``arg_parser=None`` removes it.
    """
    if not isinstance(arg_data_type, type):
        raise TypeError(f"registerCustomArgParser: arg_data_type must be a class, got "
                        f"{arg_data_type!r}.")
    if arg_parser is not None and not isinstance(arg_parser, ICustomArgParser):
        raise PoptorchTypeError("registerCustomArgParser: arg_parser must be an instance of "
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


def registerArgParserAddOn(library: str, register: Callable[[], None]) -> None:
    """An add-on package's registration of its parsers for ``library``'s types.

    The add-on calls it when imported (after registering its parsers with
    :func:`registerCustomArgParser`); ``register`` registers them again on request and
    changes nothing when they are registered already (``poptorch_geometric`` does this
    for ``"torch_geometric"``: see :func:`registerGeometricCustomArgParsers`).
    """
    _addons[library] = register


def registerGeometricCustomArgParsers() -> None:
    """Register the parsers of ``torch_geometric``'s ``Data``, ``HeteroData`` and their
    batch classes (``poptorch_geometric.PyGArgsParser``).

    ``import poptorch_geometric`` registers them: poptorch never imports its add-ons, so
    this call (kept for programs that make it) only registers them again. Without
    ``torch_geometric`` installed there is nothing to register: the call logs that at
    INFO and returns; with it installed but ``poptorch_geometric`` not imported it raises
    ``ImportError`` saying so.
    """
    if importlib.util.find_spec("torch_geometric") is None:
        info_once("registerGeometricCustomArgParsers",
                  "registerGeometricCustomArgParsers: torch_geometric is not installed; "
                  "no parsers registered.")
        return
    register = _addons.get("torch_geometric")
    if register is None:
        raise ImportError("registerGeometricCustomArgParsers: the parsers of PyG's graphs "
                          "come with poptorch_geometric: `import poptorch_geometric` "
                          "registers them (poptorch does not import its add-ons).")
    register()
