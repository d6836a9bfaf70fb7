"""The operators upstream registered as ``torch.ops.poptorch.*`` that programs call
directly: ``push_name_scope`` / ``pop_name_scope`` (Graphcore's CNN trainer calls them
from module hooks to name every layer's operators) and ``internal_cast``.

They are ``torch.library`` operators, so ``torch.ops.poptorch.<name>`` resolves and
``torch.compile`` keeps them in its graph:

* ``push_name_scope(str name) -> ()`` / ``pop_name_scope() -> ()``: inside a PopTorch
  model's call (``poptorch.isRunningOnIpu()``) they open and close a
  :py:class:`poptorch.NameScope` (a named range in the profiling trace, nested scopes
  joined with ``/``, :py:func:`current_name_scope`); outside one they do nothing, as
  upstream's ops only meant something while tracing for the IPU.
* ``internal_cast(Tensor self, str dtype) -> Tensor``: ``"FLOAT"`` casts to float32,
  ``"FLOAT16"`` to float16 (differentiable, as ``Tensor.to``).
"""
from __future__ import annotations

import threading

import torch
from torch.fx.node import has_side_effect

from .._runtime.context import is_running_on_ipu
from ..errors import Error
from .scopes import NameScope

__all__ = ["CAST_TYPES"]

# internal_cast's dtype names (PopART's type names, as upstream's poptorch.cast passes).
CAST_TYPES = {"FLOAT": torch.float32, "FLOAT16": torch.float16}

_lib = torch.library.Library("poptorch", "FRAGMENT")
_lib.define("push_name_scope(str name) -> ()")
_lib.define("pop_name_scope() -> ()")
_lib.define("internal_cast(Tensor self, str dtype) -> Tensor")

_local = threading.local()


def _open() -> list:
    if not hasattr(_local, "open"):
        _local.open = []
    return _local.open


def _push_name_scope(name: str) -> None:
    if not is_running_on_ipu():
        return
    scope = NameScope(name)
    scope.__enter__()
    _open().append(scope)


def _pop_name_scope() -> None:
    scopes = _open()
    if not is_running_on_ipu():
        return
    if not scopes:
        raise Error("torch.ops.poptorch.pop_name_scope: no name scope is open; call "
                    "push_name_scope(name) before each pop_name_scope().")
    scopes.pop().__exit__(None, None, None)


def _internal_cast(tensor: torch.Tensor, dtype: str) -> torch.Tensor:
    target = CAST_TYPES.get(dtype)
    if target is None:
        raise Error(f"torch.ops.poptorch.internal_cast: unknown dtype {dtype!r}; expected "
                    f"one of {sorted(CAST_TYPES)} (float32 or float16).")
    return tensor.to(target)


# No tensor arguments: the dispatcher has no backend key to pick, so the Python kernels
# are registered for every backend (CompositeExplicitAutograd) and the fake tensor mode
# of torch.compile's tracing does nothing.
_lib.impl("push_name_scope", _push_name_scope, "CompositeExplicitAutograd")
_lib.impl("pop_name_scope", _pop_name_scope, "CompositeExplicitAutograd")
_lib.impl("internal_cast", _internal_cast, "CompositeImplicitAutograd")
torch.library.register_fake("poptorch::push_name_scope", lambda name: None, lib=_lib)
torch.library.register_fake("poptorch::pop_name_scope", lambda: None, lib=_lib)
# Ops without outputs must survive graph dead-code elimination under torch.compile.
has_side_effect(torch.ops.poptorch.push_name_scope.default)
has_side_effect(torch.ops.poptorch.pop_name_scope.default)
