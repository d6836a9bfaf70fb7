"""Constant and variable optimizer attributes, and the ``setOptimizer`` checks.

PopTorch embeds *constant* optimizer attributes into the compiled program, so they
cannot change after compilation; *variable* ones can, through ``setOptimizer``:

* ``poptorch.optim`` optimizers: attributes passed to the constructor (or set in a
  param group) are variable, the others constant; ``variable_attrs.markAsConstant`` /
  ``markAsVariable`` override this before compilation.
* ``torch.optim`` optimizers: attributes left at the constructor's default are
  constant, except ``lr``, which is always variable.
* Structural attributes (accumulator types, ``use_combined_accum``) shape the
  compiled program and are always constant, even with ``relaxOptimizerAttributesChecks``.

The executor calls :func:`snapshot_constants` when it compiles, :func:`check_update`
in ``setOptimizer`` and :func:`copy_hyperparameters` to bring the new values to the
optimizer that runs on the device.
"""
from __future__ import annotations

import copy
import inspect
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol, cast

import torch

from .._logging import logger
from .._typing import ParamGroup, StateValue
from ..errors import Error, PoptorchAssertionError

__all__ = [
    "OptimizerSnapshot",
    "VariableAttributes",
    "check_update",
    "copy_hyperparameters",
    "is_constant",
    "restore_constants",
    "snapshot_constants",
]


# Constructor arguments of torch.optim optimizers that select an implementation
# rather than a hyperparameter: never tracked.
_IMPLEMENTATION_FLAGS = frozenset(
    {"params", "self", "foreach", "fused", "capturable", "differentiable"})


class VariableAttributes:
    """Track which attributes are variable or constant.

    Is accessible via any PopTorch optimizer via the ``variable_attrs`` attribute.

    >>> opt = poptorch.optim.SGD(params, lr=0.01)
    >>> opt.variable_attrs.isConstant("lr")
    False
    """

    def __init__(self, variable_attributes: Iterable[str],
                 allowed_attributes: Iterable[str]) -> None:
        """
        :param variable_attributes: list of variable attributes.
        :param allowed_attributes: list of all the attributes.
        """
        # Upstream's attribute names (programs and tests reach for them): plain lists.
        self._allowed_attributes = list(allowed_attributes)
        self._variable_attributes: list = []
        for attr in variable_attributes:
            self.markAsVariable(attr)

    def isConstant(self, attr: str) -> bool:
        """Return True if the attribute is marked as constant"""
        return attr not in self._variable_attributes

    def markAsConstant(self, attr: str) -> None:
        """Explicitly mark an attribute as constant"""
        self._check_allowed(attr)
        self._variable_attributes = [a for a in self._variable_attributes if a != attr]

    def markAsVariable(self, attr: str) -> None:
        """Explicitly mark an attribute as variable"""
        self._check_allowed(attr)
        if attr not in self._variable_attributes:
            self._variable_attributes.append(attr)

    @property
    def allowed_attributes(self) -> tuple[str, ...]:
        """Every attribute whose constness can be chosen."""
        return tuple(self._allowed_attributes)

    def _check_allowed(self, attr: str) -> None:
        if attr not in self._allowed_attributes:  # upstream: an assert
            raise PoptorchAssertionError(
                f"Unknown optimizer attribute {attr!r}: it cannot be marked constant or "
                f"variable. Attributes that can: {', '.join(self._allowed_attributes)}.")

    def __repr__(self) -> str:
        return (f"VariableAttributes(variable={sorted(self._variable_attributes)}, "
                f"allowed={list(self._allowed_attributes)})")


class PoptorchOptimizer(Protocol):
    """What this package reads of a ``poptorch.optim`` optimizer (``base.Optimizer``,
    which imports this module): its attribute tables, variable attributes, param groups
    and per-parameter state."""

    variable_attrs: VariableAttributes

    @property
    def param_groups(self) -> list[ParamGroup]: ...
    @property
    def state(self) -> Mapping[torch.Tensor, dict[str, StateValue]]: ...
    @property
    def _group_attrs(self) -> Mapping[str, object]: ...
    @property
    def _optimizer_attrs(self) -> Mapping[str, object]: ...
    @property
    def _structural_attrs(self) -> Mapping[str, object]: ...
    def _initial_state(self, p: torch.Tensor) -> dict[str, torch.Tensor]: ...


# --- which attributes an optimizer has, and their values ---------------------------

def _is_poptorch_optimizer(optimizer: torch.optim.Optimizer) -> bool:
    return hasattr(optimizer, "variable_attrs") and hasattr(optimizer, "_group_attrs")


def _torch_defaults(optimizer: torch.optim.Optimizer) -> dict[str, object]:
    """Constructor defaults of a torch.optim optimizer's hyperparameters."""
    signature = inspect.signature(type(optimizer).__init__)
    return {name: p.default for name, p in signature.parameters.items()
            if name not in _IMPLEMENTATION_FLAGS
            and p.default is not inspect.Parameter.empty
            and p.kind is not inspect.Parameter.VAR_KEYWORD}


def _group_values(optimizer: torch.optim.Optimizer, name: str) -> tuple[object, ...]:
    return tuple(_plain(group.get(name)) for group in optimizer.param_groups)


def _plain(value: object) -> object:
    """A comparable, copy-safe form of an attribute value (tensors become numbers)."""
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, (tuple, list)):
        return tuple(_plain(v) for v in value)
    return value


def _same(a: object, b: object) -> bool:
    return _plain(a) == _plain(b)


def attribute_values(optimizer: torch.optim.Optimizer) -> dict[str, object]:
    """Every tracked attribute of ``optimizer``: ``name -> value`` for optimizer-level
    attributes and ``name -> (value per param group)`` for group hyperparameters."""
    if _is_poptorch_optimizer(optimizer):
        ours = cast(PoptorchOptimizer, optimizer)  # PopTorch's attribute tables
        values: dict[str, object] = {name: _group_values(optimizer, name)
                                     for name in ours._group_attrs}
        for name in (*ours._optimizer_attrs, *ours._structural_attrs):
            values[name] = _plain(getattr(optimizer, name))
        return values
    return {name: _group_values(optimizer, name) for name in _torch_defaults(optimizer)}


def is_constant(optimizer: torch.optim.Optimizer, name: str) -> bool:
    """Whether ``name`` is constant for ``optimizer`` under PopTorch's rules."""
    if _is_poptorch_optimizer(optimizer):
        ours = cast(PoptorchOptimizer, optimizer)
        if name in ours._structural_attrs:
            return True
        return ours.variable_attrs.isConstant(name)
    if name == "lr":
        return False
    default = _torch_defaults(optimizer).get(name, inspect.Parameter.empty)
    return all(_same(v, default) for v in _group_values(optimizer, name))


def _structural(optimizer: torch.optim.Optimizer) -> frozenset:
    return frozenset(getattr(optimizer, "_structural_attrs", ()))


# --- compile-time snapshot and setOptimizer checks ---------------------------------

@dataclass(frozen=True)
class OptimizerSnapshot:
    """What the compiled program fixed about the optimizer."""
    optimizer_type: type
    group_sizes: tuple[int, ...]
    constants: dict[str, object] = field(default_factory=dict)
    structural: frozenset = frozenset()


def snapshot_constants(optimizer: torch.optim.Optimizer) -> OptimizerSnapshot:
    """Record the optimizer's type, param-group layout and constant attribute values
    (called when the training model is compiled)."""
    values = attribute_values(optimizer)
    constants = {name: copy.deepcopy(value) for name, value in values.items()
                 if is_constant(optimizer, name)}
    return OptimizerSnapshot(type(optimizer),
                             tuple(len(g["params"]) for g in optimizer.param_groups),
                             constants, _structural(optimizer))


def check_update(snapshot: OptimizerSnapshot, new_optimizer: torch.optim.Optimizer,
                 relax: bool) -> None:
    """Check that ``new_optimizer`` may replace the compiled one in ``setOptimizer``.

    A ``poptorch.optim`` optimizer and the ``torch.optim`` one it derives from implement
    the same algorithm and may replace each other (as in PopTorch); the PopTorch extras
    then take their defaults. Raises ``poptorch.Error`` if the algorithm or the
    param-group layout changed, or
    if a constant attribute has a new value. With ``relax`` (the option
    ``relaxOptimizerAttributesChecks``) a changed constant hyperparameter is only
    logged as a warning and the caller applies it; structural attributes (state
    dtypes, SGD variant) can never change without recompiling.
    """
    if not isinstance(new_optimizer, torch.optim.Optimizer):
        raise Error(f"setOptimizer expects a torch.optim or poptorch.optim optimizer, "
                    f"got {type(new_optimizer).__name__}.")
    switching = type(new_optimizer) is not snapshot.optimizer_type
    if switching and _family(type(new_optimizer)) is not _family(snapshot.optimizer_type):
        raise Error(f"The model was compiled with a {_qualname(snapshot.optimizer_type)} "
                    f"optimizer; setOptimizer cannot switch it to "
                    f"{_qualname(type(new_optimizer))}. Create a new trainingModel to "
                    f"use a different optimizer type.")
    sizes = tuple(len(g["params"]) for g in new_optimizer.param_groups)
    if sizes != snapshot.group_sizes:
        raise Error(f"The new optimizer's param groups (sizes {list(sizes)}) do not "
                    f"match the compiled ones (sizes {list(snapshot.group_sizes)}). "
                    f"setOptimizer can change hyperparameters, not which parameters "
                    f"are optimized.")
    new_values = attribute_values(new_optimizer)
    for name, compiled in snapshot.constants.items():
        if switching and name not in new_values:
            continue  # a PopTorch extra the new (torch.optim) optimizer does not have
        new = new_values.get(name)
        if _same(compiled, new):
            continue
        shown_old, shown_new = _shown(compiled), _shown(new)
        if name in snapshot.structural:
            raise Error(f"Optimizer attribute {name!r} changed from {shown_old} to "
                        f"{shown_new}, but it fixes the structure of the compiled "
                        f"program and can never change after compilation. Create a "
                        f"new trainingModel with the new optimizer instead.")
        message = (f"Optimizer attribute {name!r} is constant: it was compiled with "
                   f"the value {shown_old} and setOptimizer got {shown_new}.")
        if not relax:
            raise Error(f"{message} To be able to change it, mark it variable before "
                        f"compiling (poptorch.optim optimizers: pass it to the "
                        f"constructor or call optimizer.variable_attrs.markAsVariable"
                        f"({name!r}); torch.optim optimizers: set it to a non-default "
                        f"value), or call options.relaxOptimizerAttributesChecks() to "
                        f"turn this error into a warning.")
        logger.warning("%s The new value is applied because "
                       "relaxOptimizerAttributesChecks is set.", message)


def restore_constants(snapshot: OptimizerSnapshot,
                      optimizer: torch.optim.Optimizer) -> None:
    """Put the compiled values of the constant attributes back into ``optimizer``.

    On the CPU the optimizer a model was compiled with *is* the one that steps the
    device parameters, so a constant changed in it and refused by ``setOptimizer``
    would otherwise be used by the next calls anyway."""
    values = attribute_values(optimizer)
    group_attrs = getattr(optimizer, "_group_attrs", None)
    for name, compiled in snapshot.constants.items():
        if name not in values or _same(values[name], compiled):
            continue
        if group_attrs is None or name in group_attrs:
            per_group = cast("tuple[object, ...]", compiled)  # (_group_values)
            for group, value in zip(optimizer.param_groups, per_group, strict=False):
                group[name] = _restored(group.get(name), value)
        else:
            setattr(optimizer, name, _restored(getattr(optimizer, name), compiled))


def _restored(current: object, value: object) -> object:
    """``value`` (a plain snapshot value) in the form of ``current``."""
    if isinstance(current, torch.Tensor):
        return torch.as_tensor(value, dtype=current.dtype, device=current.device)
    return copy.deepcopy(value)


def _family(cls: type) -> type:
    """The algorithm an optimizer class implements: the torch.optim class it is or
    derives from (``poptorch.optim.SGD`` and ``torch.optim.SGD`` are both SGD), or the
    class itself when there is none (``poptorch.optim.LAMB``)."""
    for base in cls.__mro__:
        if base.__module__.startswith("torch.optim") and base is not torch.optim.Optimizer:
            return base
    return cls


def copy_hyperparameters(src_optimizer: torch.optim.Optimizer,
                         dst_optimizer: torch.optim.Optimizer) -> None:
    """Give ``dst_optimizer`` the hyperparameters of ``src_optimizer`` (per param group
    and, for poptorch optimizers, optimizer-level attributes such as
    ``loss_scaling``), leaving ``dst_optimizer``'s parameters and state untouched."""
    if type(src_optimizer) is not type(dst_optimizer):
        raise Error(f"Cannot copy hyperparameters from {_qualname(type(src_optimizer))} "
                    f"to {_qualname(type(dst_optimizer))}: the types differ.")
    if len(src_optimizer.param_groups) != len(dst_optimizer.param_groups):
        raise Error("Cannot copy hyperparameters between optimizers with different "
                    "numbers of param groups.")
    for src, dst in zip(src_optimizer.param_groups, dst_optimizer.param_groups, strict=False):
        for key, value in src.items():
            if key != "params":
                dst[key] = copy.deepcopy(value)
    dst_optimizer.defaults = copy.deepcopy(src_optimizer.defaults)
    if _is_poptorch_optimizer(src_optimizer):
        ours = cast(PoptorchOptimizer, src_optimizer)
        target = cast(PoptorchOptimizer, dst_optimizer)
        for name in (*ours._optimizer_attrs, *ours._structural_attrs):
            setattr(dst_optimizer, name, copy.deepcopy(getattr(src_optimizer, name)))
        target.variable_attrs = copy.deepcopy(ours.variable_attrs)


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _shown(value: object) -> str:
    if isinstance(value, tuple) and value and all(_same(v, value[0]) for v in value):
        # Group hyperparameter with the same value in every group.
        return repr(value[0])
    if isinstance(value, tuple):
        return f"{list(value)} (per param group)"
    return repr(value)

