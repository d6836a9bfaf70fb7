"""``PyGArgsParser``: PyG graphs and batches as model arguments.

Registered with :py:func:`poptorch.registerCustomArgParser` for ``Data``,
``HeteroData`` and their batch classes, so a wrapped model takes them like tuples of
tensors: their tensors are its inputs (split along dimension 0 between the micro-batches
of a call), everything else (names, counts) is carried along unchanged.
"""
from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import torch
from torch_geometric.data import Data, HeteroData
from torch_geometric.data.data import BaseData

import poptorch
from poptorch.executor.argparsers import registerArgParserAddOn

from .common import DataBatch, HeteroDataBatch

__all__ = ["GRAPH_TYPES", "PyGArgsParser", "registerCustomArgParsers"]

GRAPH_TYPES: tuple[type, ...] = (Data, HeteroData, DataBatch, HeteroDataBatch)
"""The classes the parser is registered for (PyG's batch classes are subclasses of
``Data`` / ``HeteroData`` that a registration of those does not cover)."""


class PyGArgsParser(poptorch.ICustomArgParser[BaseData]):
    """Takes a PyG ``Data`` / ``HeteroData`` / ``Batch`` apart into its tensors and
    builds one like it from new tensors.

    The tensors are those of each store of the graph (``data.stores``: the graph's own,
    then one per node type and per edge type), in sorted key order within a store.
    """

    @staticmethod
    def _slots(struct: BaseData) -> list[tuple[Any, str]]:
        if not isinstance(struct, BaseData):
            raise ValueError(f"Unsupported data type: {type(struct)} (PyGArgsParser takes "
                             "torch_geometric Data, HeteroData and Batch objects).")
        return [(store, key) for store in struct.stores for key in sorted(store.keys())
                if isinstance(store[key], torch.Tensor)]

    def yieldTensors(self, struct: BaseData) -> Iterator[torch.Tensor]:
        for store, key in self._slots(struct):
            yield store[key]

    def reconstruct(self, original_structure: BaseData,
                    tensor_iterator: Iterator[torch.Tensor]) -> BaseData:
        """A shallow copy of ``original_structure`` (same class, same non-tensor
        attributes) holding the tensors of ``tensor_iterator`` instead of its own."""
        rebuilt = copy.copy(original_structure)
        for store, key in self._slots(rebuilt):
            store[key] = next(tensor_iterator)
        return rebuilt


_registered = False


def registerCustomArgParsers() -> None:
    """Registers :class:`PyGArgsParser` with poptorch for PyG's graph and batch classes,
    and itself as the add-on that does it for ``torch_geometric`` (so that
    ``poptorch.registerGeometricCustomArgParsers()`` finds it: poptorch never imports
    ``poptorch_geometric``). Done when ``poptorch_geometric`` is imported; calling it
    again changes nothing."""
    global _registered
    if _registered:
        return
    parser = PyGArgsParser()
    for graph_type in GRAPH_TYPES:
        poptorch.registerCustomArgParser(graph_type, parser)
    registerArgParserAddOn("torch_geometric", registerCustomArgParsers)
    _registered = True
