"""Puts PopTorch Geometric's ops and layers in place of PyG's while a model runs.

``_TorchGeometricOpsSubstitutionManager`` is registered with PopTorch's executor
(``poptorch._poplar_executor._OverwriteContextManager.registerSubsitutionManager``),
which replaces around every call of a wrapped model and restores afterwards, also when
the call raises. Outside a wrapped model PyG is untouched.

What is replaced (PyG 2.8 names; an attribute an installed PyG lacks is left out):

* ``knn``, ``knn_graph``, ``radius``, ``radius_graph``, ``nearest`` and ``fps`` of
  ``torch_geometric.nn`` and ``torch_geometric.nn.pool`` (which need pyg-lib in PyG 2.8),
  and all but ``fps`` of ``torch_cluster`` when it is installed. The edge functions
  return PyG's result (the ``-1`` slots of the static-shape ops dropped), so PyG code
  that uses the edges directly keeps working;
* ``knn_interpolate`` of ``torch_geometric.nn`` and ``torch_geometric.nn.unpool``;
* ``forward`` of ``ClusterGCNConv``, ``HeteroLinear``, ``InstanceNorm``, ``MFConv`` and
  ``Aggregation.assert_sorted_index``: versions of fixed shapes that a compiled program
  captures whole.

PopTorch also switched on PyG's ``disable_dynamic_shapes`` experimental mode (errors
for a missing ``dim_size`` / ``max_num_nodes``: an IPU needs static shapes); our
devices run dynamic shapes, so it is left as the program set it.
"""
from __future__ import annotations

import functools
import importlib
import importlib.util
import threading
from collections.abc import Callable
from types import TracebackType
from typing import Any, ClassVar

import torch
import torch_geometric
import torch_geometric.nn.aggr.base
import torch_geometric.nn.pool
import torch_geometric.nn.unpool

import poptorch
from poptorch._logging import info_once

from . import ops
from .ops._points import without_padding

__all__ = ["_TorchGeometricOpsSubstitutionManager", "registerOptionalOverrides"]


def _dropping_padding(op: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``op`` with its empty (``-1``) edge slots dropped: PyG's result shape."""
    @functools.wraps(op)
    def compacted(*args: Any, **kwargs: Any) -> torch.Tensor:
        return without_padding(op(*args, **kwargs))
    return compacted


_PYG_KNN = _dropping_padding(ops.knn)
_PYG_KNN_GRAPH = _dropping_padding(ops.knn_graph)
_PYG_RADIUS = _dropping_padding(ops.radius)
_PYG_RADIUS_GRAPH = _dropping_padding(ops.radius_graph)

_POINT_FUNCTIONS: dict[str, Callable[..., Any]] = {
    "knn": _PYG_KNN,
    "knn_graph": _PYG_KNN_GRAPH,
    "radius": _PYG_RADIUS,
    "radius_graph": _PYG_RADIUS_GRAPH,
    "nearest": poptorch.nearest,
}


def _existing(target: Any, replacements: dict[str, Callable[..., Any]]
              ) -> dict[str, Callable[..., Any]]:
    """The entries of ``replacements`` that ``target`` has (PyG versions differ)."""
    return {name: f for name, f in replacements.items() if hasattr(target, name)}


class _TorchGeometricOpsSubstitutionManager:
    """Replaces PyG functions and methods with PopTorch Geometric's (PopTorch's name).

    ``subsitutions`` (PopTorch's spelling) maps a module or class to ``{attribute:
    replacement}``. The installed objects are made once per original, so a compiled
    program that captured them sees the same objects on every call.
    """

    subsitutions: ClassVar[dict[Any, dict[str, Callable[..., Any]]]] = {
        torch_geometric.nn: _existing(torch_geometric.nn, {
            **_POINT_FUNCTIONS, "fps": ops.fps, "knn_interpolate": ops.knn_interpolate}),
        torch_geometric.nn.pool: _existing(torch_geometric.nn.pool, {
            **_POINT_FUNCTIONS, "fps": ops.fps}),
        torch_geometric.nn.unpool: {"knn_interpolate": ops.knn_interpolate},
        torch_geometric.nn.aggr.base.Aggregation: {
            "assert_sorted_index": ops.Aggregation.assert_sorted_index},
        torch_geometric.nn.ClusterGCNConv: {"forward": ops.ClusterGCNConv.forward},
        torch_geometric.nn.HeteroLinear: {"forward": ops.HeteroLinear.forward},
        torch_geometric.nn.InstanceNorm: {"forward": ops.InstanceNorm.forward},
        torch_geometric.nn.MFConv: {"forward": ops.MFConv.forward},
    }

    # (target, name) -> (original, installed wrapper)
    _wrappers: ClassVar[dict[tuple[Any, str], tuple[Any, Callable[..., Any]]]] = {}
    _wrappers_lock = threading.Lock()

    def __init__(self) -> None:
        # (target, name, original, whether the target itself defined it), in order
        self.overrides: list[tuple[Any, str, Any, bool]] = []

    def __enter__(self) -> _TorchGeometricOpsSubstitutionManager:
        self.replace()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, value: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.restore()

    @classmethod
    def _wrapper(cls, target: Any, name: str, original: Any,
                 replacement: Callable[..., Any]) -> Callable[..., Any]:
        """The object standing in for ``original`` (made once, then reused)."""
        known = cls._wrappers.get((target, name))
        if known is not None and known[0] is original:
            return known[1]
        with cls._wrappers_lock:

            @functools.wraps(original)
            def substituted(*args: Any, **kwargs: Any) -> Any:
                return replacement(*args, **kwargs)

            cls._wrappers[(target, name)] = (original, substituted)
            return substituted

    def replace(self) -> None:
        """Install every substitution, remembering what was there.

        Runs around every model call, so it does little: a lookup and a ``setattr``
        per entry once the wrappers exist."""
        saved = self.overrides
        try:
            for target, replacements in self.subsitutions.items():
                is_class = isinstance(target, type)
                for name, replacement in replacements.items():
                    original = getattr(target, name)
                    own = not is_class or name in target.__dict__
                    saved.append((target, name, original, own))
                    setattr(target, name, self._wrapper(target, name, original, replacement))
        except BaseException:
            self.restore()
            raise

    def restore(self) -> None:
        """Put back what ``replace`` found (attributes inherited before stay inherited)."""
        saved, self.overrides = self.overrides, []
        for target, name, original, own in reversed(saved):
            if own:
                setattr(target, name, original)
            else:
                delattr(target, name)


_optional_lock = threading.Lock()
_optional_registered = False


def _add_torch_cluster(torch_cluster: Any) -> None:
    """Replace ``torch_cluster``'s point functions too (it has PyG's semantics)."""
    _TorchGeometricOpsSubstitutionManager.subsitutions[torch_cluster] = _existing(
        torch_cluster, _POINT_FUNCTIONS)


def registerOptionalOverrides() -> None:
    """Also replace ``torch_cluster``'s point functions when it is installed (once)."""
    global _optional_registered
    with _optional_lock:
        if _optional_registered:
            return
        _optional_registered = True
        try:
            if importlib.util.find_spec("torch_cluster") is None:
                return
            torch_cluster = importlib.import_module("torch_cluster")
        except (ImportError, OSError, ValueError) as error:  # a build for another torch
            info_once(("poptorch_geometric", "torch_cluster"),
                      "poptorch_geometric: torch_cluster is installed but cannot be "
                      "imported (%s); its functions are not replaced", error)
            return
        _add_torch_cluster(torch_cluster)


registerOptionalOverrides()
