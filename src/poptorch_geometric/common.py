"""The batch classes PyG builds for ``Data`` and ``HeteroData``, named once.

``torch_geometric.data.Batch`` makes a class per data class on first use
(``Batch(_base_cls=Data)`` is an instance of a class PyG calls ``DataBatch``); custom
argument parsers and dispatch on batch types need those classes themselves.
"""
from __future__ import annotations

from torch_geometric.data import Batch, Data, HeteroData

__all__ = ["DataBatch", "HeteroDataBatch"]

DataBatch: type = type(Batch(_base_cls=Data))
HeteroDataBatch: type = type(Batch(_base_cls=HeteroData))
