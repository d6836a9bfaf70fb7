"""Automatic mixed-precision casting (user guide: "Automatic mixed-precision casting",
"Custom casting policies").

* ``model.autocast()`` / ``layer.autocast(False)``: switch autocasting on or off for a
  module and every module it contains (the innermost setting wins);
* ``@poptorch.autocast(enabled=True)`` on a function, ``with poptorch.autocast():``
  around a block: the same switch for the code inside;
* :class:`Policy`: which operators and module classes compute in float16 (``fp16``),
  in float32 (``fp32``), in float32 when given mixed precision (``promote``) or in
  float16 when given mixed precision (``demote``); :data:`default` is the policy used
  unless ``opts.Precision.autocastPolicy(policy)`` picks another;
* ``opts.Precision.autocastEnabled(False)`` turns all of it off.

Autocasting happens while a model wrapped by ``poptorch.inferenceModel`` /
``trainingModel`` runs; the engine is ``_runtime/numerics/autocast.py`` (a torch function mode,
so casts are recorded by autograd and float32 weights receive float32 gradients).
"""
from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Protocol, TypeGuard, cast

import torch

from ._runtime.numerics.autocast import (
    AutocastRun,
    CastRules,
    canonical_name,
    enter_region,
    exit_region,
    install_module_hooks,
    op_name,
)
from ._runtime.numerics.casting import DefaultCasting
from ._runtime.weights.modelcopy import iter_module_pairs
from ._typing import UserInput, UserOutput
from .errors import Error

if TYPE_CHECKING:
    from ._runtime.config import PrecisionConfig

# A policy entry: a torch operator (torch.relu, torch.Tensor.mul, F.relu, or its name)
# or a torch.nn.Module class.
PolicyEntry = Callable[..., object] | str


class _Switchable(Protocol):
    _poptorch_autocast: bool

__all__ = [
    "Policy",
    "autocast",
    "default",
    "default_demote",
    "default_fp16",
    "default_fp32",
    "default_promote",
]


class autocast:
    """Switch automatic casting on (``enabled=True``, the default) or off for the code
    it wraps: use it as a context manager or as a function decorator.

    >>> with poptorch.autocast():
    ...     z = torch.bmm(x, y)      # float16 inside a PopTorch model

    >>> class Model(torch.nn.Module):
    ...     @poptorch.autocast(enabled=False)
    ...     def forward(self, x):    # never autocast
    ...         ...
    """

    def __init__(self, enabled: bool = True) -> None:
        if not isinstance(enabled, bool):
            raise Error(f"poptorch.autocast: enabled must be True or False, got "
                        f"{enabled!r}.")
        self.enabled = enabled

    def __enter__(self) -> autocast:
        enter_region(self.enabled)
        return self

    def __exit__(self, *exc: object) -> None:
        exit_region()

    def __call__(self, func: Callable) -> Callable:
        if not callable(func):
            raise Error(f"poptorch.autocast: can only decorate a function, got "
                        f"{type(func).__name__}.")
        enabled = self.enabled

        @functools.wraps(func)
        def autocast_wrapper(*args: UserInput, **kwargs: UserInput) -> UserOutput:
            enter_region(enabled)
            try:
                return func(*args, **kwargs)
            finally:
                exit_region()

        return autocast_wrapper


def _is_module_class(entry: object) -> TypeGuard[type[torch.nn.Module]]:
    return isinstance(entry, type) and issubclass(entry, torch.nn.Module)


def _entry_key(entry: object, list_name: str) -> type | str:
    """A module class, or the operator name of a torch function / Tensor method /
    functional (``torch.relu``, ``torch.Tensor.mul``, ``F.relu``) or of a string."""
    if _is_module_class(entry):
        return entry
    if isinstance(entry, str) and entry:
        return canonical_name(entry)
    if callable(entry) and getattr(entry, "__name__", None):
        return op_name(entry)
    raise Error(f"poptorch.autocasting.Policy: {list_name} entries must be torch "
                f"operators (such as torch.relu) or torch.nn.Module classes (such as "
                f"torch.nn.Conv2d); got {entry!r}.")


def _keys(entries: Iterable[PolicyEntry] | None, list_name: str) -> list:
    if entries is None:
        return []
    if isinstance(entries, (str, bytes)) or not isinstance(entries, (list, tuple, set,
                                                                     frozenset)):
        raise Error(f"poptorch.autocasting.Policy: {list_name} must be a list of torch "
                    f"operators and/or module classes, got {entries!r}.")
    return [_entry_key(e, list_name) for e in entries]


_LISTS = ("fp16", "fp32", "promote", "demote")


class Policy:
    """A casting policy: four lists of torch operators and/or ``torch.nn.Module``
    classes.

    :param fp16: operators and layers computed in float16
    :param fp32: operators and layers computed in float32
    :param promote: operators and layers computed in float32 when their inputs mix
        float16 and float32
    :param demote: operators and layers computed in float16 when their inputs mix
        float16 and float32

    A list left as ``None`` takes the default policy's list (so ``Policy()`` is the
    default policy), minus anything placed in another list explicitly; pass ``[]`` for
    an empty list. An entry may appear in one list only. A module class makes the
    module one unit: all its operations (its weights included) compute in the list's
    type, and operator rules do not apply inside it. bfloat16 inputs keep bfloat16
    where float16 would be chosen.
    """

    def __init__(self, fp16: Iterable[PolicyEntry] | None = None,
                 fp32: Iterable[PolicyEntry] | None = None,
                 promote: Iterable[PolicyEntry] | None = None,
                 demote: Iterable[PolicyEntry] | None = None) -> None:
        given = dict(zip(_LISTS, (fp16, fp32, promote, demote), strict=False))
        explicit = {name: _keys(value, name) for name, value in given.items()
                    if value is not None}
        seen: dict = {}
        for name, keys in explicit.items():
            for key in keys:
                if key in seen and seen[key] != name:
                    raise Error(f"poptorch.autocasting.Policy: {_describe(key)} is in both "
                                f"{seen[key]} and {name}; put it in one list only.")
                seen[key] = name
        defaults = {"fp16": default_fp16, "fp32": default_fp32,
                    "promote": default_promote, "demote": default_demote}
        lists = {}
        for name in _LISTS:
            if name in explicit:
                lists[name] = explicit[name]
            else:
                lists[name] = [k for k in _keys(defaults[name], name) if k not in seen]
        self.fp16 = list(fp16) if fp16 is not None else list(defaults["fp16"])
        self.fp32 = list(fp32) if fp32 is not None else list(defaults["fp32"])
        self.promote = list(promote) if promote is not None else list(defaults["promote"])
        self.demote = list(demote) if demote is not None else list(defaults["demote"])
        self._lists = lists

    def rules(self) -> CastRules:
        """The engine's form of this policy (operator names and module classes)."""
        def ops(name: str) -> frozenset[str]:
            return frozenset(k for k in self._lists[name] if isinstance(k, str))

        def modules(name: str) -> tuple[type[torch.nn.Module], ...]:
            return tuple(k for k in self._lists[name] if _is_module_class(k))
        return CastRules(ops("fp16"), ops("fp32"), ops("promote"), ops("demote"),
                         modules("fp16"), modules("fp32"), modules("promote"),
                         modules("demote"))

    def __repr__(self) -> str:
        parts = ", ".join(f"{name}=[{', '.join(_describe(k) for k in self._lists[name])}]"
                          for name in _LISTS)
        return f"poptorch.autocasting.Policy({parts})"


def _describe(key: object) -> str:
    return key.__name__ if isinstance(key, type) else f"'{key}'"


def _module_autocast(self: torch.nn.Module, enabled: bool = True) -> torch.nn.Module:
    """Switch automatic casting on or off for this module and the modules inside it
    (a setting on an inner module wins). Takes effect when the module runs inside a
    PopTorch model. Returns the module."""
    if not isinstance(enabled, bool):
        raise Error(f"{type(self).__name__}.autocast: enabled must be True or False, got "
                    f"{enabled!r}.")
    module = cast(_Switchable, self)  # (a plain attribute the casting engine reads)
    module._poptorch_autocast = enabled
    return self


if not hasattr(torch.nn.Module, "autocast"):
    torch.nn.Module.autocast = _module_autocast  # type: ignore[attr-defined]  # PopTorch adds Module.autocast


def _ops(*names: str) -> list:
    return [getattr(torch, n) for n in names if hasattr(torch, n)]


#: Operators and layers the default policy computes in float16 (upstream's list, plus
#: ``linear``: ``torch.nn.Linear`` calls it where upstream's tracer saw ``matmul``).
default_fp16: list = [*_ops("addbmm", "addmm", "addmv", "addr", "baddbmm", "bmm",
                             "chain_matmul", "conv1d", "conv2d", "conv3d", "conv_tbc",
                             "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
                             "convolution", "matmul", "mm", "mv"),
                       torch.nn.functional.linear, torch.nn.Conv2d]
#: The default policy has no float32-only operators.
default_fp32: list = []
#: Operators the default policy promotes to float32 when given mixed precision.
default_promote: list = _ops("addcdiv", "addcmul", "atan2", "bilinear", "cat", "cross",
                             "dot", "equal", "index_put", "stack", "tensordot")
#: The default policy demotes nothing.
default_demote: list = []

#: The default casting policy.
default = Policy()


# --------------------------------------------------------------------------------------
# Used by the executor when it compiles a model


def prepare_model(model: torch.nn.Module, user_model: torch.nn.Module,
                  precision: PrecisionConfig) -> tuple[AutocastRun, list]:
    """The context the executor enters around each call of the compiled copy ``model``:
    autocast regions and policy, and (``half_float_casting`` is ``Default``) the
    float16 rules of ``_runtime/numerics/casting.py``. Module switches are read from
    the user's modules (``user_model``), so ``layer.autocast()`` called after wrapping
    still counts. ``precision`` is ``Options.Precision`` as compiled
    (``_runtime/config.py``: ``PrecisionConfig``). Returns the context and the handles
    of the wrapped forwards."""
    from .enums import HalfFloatCastingBehavior
    default_casting = None
    if precision.half_float_casting == HalfFloatCastingBehavior.Default and any(
            t.is_floating_point() for t in itertools.chain(model.parameters(),
                                                           model.buffers())):
        default_casting = DefaultCasting(model)
    enabled = precision.autocast_enabled
    policy = cast(Policy, precision.autocast_policy) if precision.autocast_policy is not None \
        else default
    rules = policy.rules()
    handles: list = []
    if enabled:
        pairs, seen = [], set()
        for orig, copy in iter_module_pairs(user_model, model):
            if id(copy) not in seen:
                seen.add(id(copy))
                pairs.append((copy, getattr(orig, "_poptorch_autocast",
                                            getattr(copy, "_poptorch_autocast", None))))
        handles = install_module_hooks(pairs, rules)
    return AutocastRun(enabled, rules, default_casting), handles
