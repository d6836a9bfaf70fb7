"""``Options().Precision`` applied to a compiled model.

:class:`PrecisionPolicy` turns the precision options into behaviour:

* ``halfFloatCasting``: ``Default`` is PyTorch's own type promotion (nothing to do).
  ``FloatDowncastToHalf`` computes an operation mixing float16 and float32 tensors in
  float16 (the float32 tensors are cast down first); ``HalfUpcastToFloat`` computes it
  in float32 (the float16 tensors are cast up first, which also lets ``matmul``,
  ``linear`` and convolutions accept mixed inputs, as PyTorch's promotion does for
  element-wise operations). Both are a :class:`torch.overrides.TorchFunctionMode`
  active only while the device program runs, so autograd sees the casts.
* ``runningStatisticsAlwaysFloat``: batch-norm running statistics of a float16 or
  bfloat16 model are converted to float32 once (in place, so they stay shared with the
  user's module) and those normalisation layers compute in float32, returning the
  input's dtype.
* ``setPartialsType``: on CUDA, ``torch.half`` lets cuBLAS accumulate float16 matrix
  products in float16 while the program runs; ``torch.float`` is PyTorch's default. On
  the CPU it has no meaning and is logged once.
* ``enableStochasticRounding``: the weight update of float16/bfloat16 parameters is
  rounded stochastically (unbiased) instead of to nearest; see :func:`stochastic_round`.
* ``enableFloatingPointExceptions``: :meth:`PrecisionPolicy.check_step` raises
  :class:`poptorch.Error` when an output or a parameter holds inf or NaN.
"""
from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import cast

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ... import _logging
from ..._typing import UserOutput
from ...enums import HalfFloatCastingBehavior
from ...errors import Error
from ..config import PrecisionConfig
from ..torch_internals import NormBase, pytree

__all__ = ["PrecisionPolicy", "stochastic_round", "stochastic_rounding_active"]

_LOW_PRECISION = (torch.float16, torch.bfloat16)

# --------------------------------------------------------------------------------------
# Stochastic rounding


def stochastic_round(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Round ``x`` to ``dtype`` up or down at random, so that ``E[result] == x``.

    Each value goes to one of its two neighbours in ``dtype``, the upper one with
    probability ``(x - lower) / (upper - lower)``. Values already representable, and
    non-finite results of round-to-nearest (overflow, inf, NaN), are rounded to nearest.
    Uses the default random generator of ``x``'s device (so ``randomSeed`` applies).
    """
    if x.dtype == dtype:
        return x.clone()
    wide = x.to(torch.promote_types(x.dtype, torch.float32))
    nearest = wide.to(dtype)
    near_wide = nearest.to(wide.dtype)
    toward = torch.where(near_wide > wide, torch.full_like(nearest, float("-inf")),
                         torch.full_like(nearest, float("inf")))
    other = torch.nextafter(nearest, toward)
    other_wide = other.to(wide.dtype)
    lower = torch.minimum(near_wide, other_wide)
    upper = torch.maximum(near_wide, other_wide)
    gap = upper - lower
    p_up = torch.where(torch.isfinite(gap) & (gap > 0), (wide - lower) / gap,
                       torch.zeros_like(wide))
    rounded = torch.where(torch.rand_like(wide) < p_up, upper, lower).to(dtype)
    exact_or_special = (near_wide == wide) | ~torch.isfinite(near_wide) | ~torch.isfinite(gap)
    return torch.where(exact_or_special, nearest, rounded)


_SR_ACTIVE: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "poptorch_stochastic_rounding", default=False)
_SR_FLAG = "_poptorch_stochastic_rounding"   # attribute set on the optimizer
# Class attribute of optimizers (poptorch.optim) that do their own low-precision
# arithmetic: they divide deferred loss scales in float32 and round their own writes.
LOW_PRECISION_AWARE_ATTR = "_poptorch_low_precision_aware"
# check_step's parameters: name -> tensor, (name, tensor) pairs, or tensors
NamedTensors = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor] | torch.Tensor]


def is_low_precision_aware(optimizer: object) -> bool:
    """Whether ``optimizer`` handles low-precision updates itself (poptorch.optim)."""
    return getattr(type(optimizer), LOW_PRECISION_AWARE_ATTR, False)
_SR_SAVED = "_poptorch_sr_saved"             # (param, low data, low grad) during a step


def stochastic_rounding_active() -> bool:
    """True while a poptorch.optim optimizer with stochastic rounding is stepping
    (read by ``poptorch.optim.base.apply_to_param`` when it writes a low-precision weight)."""
    return _SR_ACTIVE.get()


def _restore_swapped(optimizer: torch.optim.Optimizer, round_values: bool) -> None:
    saved = getattr(optimizer, _SR_SAVED, None)
    if not saved:
        return
    setattr(optimizer, _SR_SAVED, None)
    for p, low_data, low_grad in saved:
        if round_values:
            low_data.copy_(stochastic_round(p.data, low_data.dtype))
        p.data = low_data
        p.grad = low_grad


def _sr_pre_hook(optimizer: torch.optim.Optimizer, args: tuple[object, ...],
                 kwargs: dict[str, object]) -> None:
    """Before a step: poptorch.optim rounds its own writes (flag); for other optimizers
    low-precision parameters, their gradients and state are widened to float32."""
    if not getattr(optimizer, _SR_FLAG, False):
        return None
    if is_low_precision_aware(optimizer):
        _SR_ACTIVE.set(True)
        return None
    _restore_swapped(optimizer, round_values=False)  # a step that raised half-way
    saved = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.dtype not in _LOW_PRECISION or p.grad is None or p.grad.is_sparse:
                continue
            low_data, low_grad = p.data, p.grad
            p.data = low_data.float()
            p.grad = low_grad.float()
            state = optimizer.state.get(p, {})
            for key, value in state.items():
                if (isinstance(value, torch.Tensor) and value.dtype in _LOW_PRECISION
                        and value.shape == p.shape):
                    state[key] = value.float()
            saved.append((p, low_data, low_grad))
    setattr(optimizer, _SR_SAVED, saved)
    return None


def _sr_post_hook(optimizer: torch.optim.Optimizer, args: tuple[object, ...],
                  kwargs: dict[str, object]) -> None:
    """After a step: stochastically round the float32 results back into the
    low-precision parameters (torch.optim), or clear the flag (poptorch.optim)."""
    _SR_ACTIVE.set(False)
    _restore_swapped(optimizer, round_values=True)


def _install_sr_hooks(optimizer: torch.optim.Optimizer) -> None:
    pre = getattr(optimizer, "_optimizer_step_pre_hooks", {})
    if _sr_pre_hook not in pre.values():
        optimizer.register_step_pre_hook(_sr_pre_hook)
    post = getattr(optimizer, "_optimizer_step_post_hooks", {})
    if _sr_post_hook not in post.values():
        optimizer.register_step_post_hook(_sr_post_hook)


# --------------------------------------------------------------------------------------
# Half/float casting

# Functions that convert dtypes or write into an argument (batch norm's running
# statistics): casting their arguments would change what they mean.
_NEVER_CAST = {
    torch.Tensor.to, torch.Tensor.type, torch.Tensor.type_as, torch.Tensor.__setitem__,
    torch.Tensor.new_tensor, F.batch_norm, torch.batch_norm, torch.native_batch_norm,
    F.instance_norm, torch.instance_norm,
}
_INPLACE_DUNDERS = {"__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__",
                    "__imod__", "__ipow__", "__iand__", "__ior__", "__ixor__",
                    "__ilshift__", "__irshift__", "__imatmul__"}


def _writes_in_place(func: Callable[..., object], kwargs: Mapping[str, object]) -> bool:
    name = getattr(func, "__name__", "")
    return ("out" in kwargs or name in _INPLACE_DUNDERS
            or (name.endswith("_") and not name.endswith("__")))


def _float_dtypes(values: Iterable[object], found: set) -> None:
    for v in values:
        if isinstance(v, torch.Tensor):
            found.add(v.dtype)
        elif isinstance(v, (list, tuple)):
            _float_dtypes(v, found)


class _MixedPrecisionCasting(TorchFunctionMode):
    """Casts ``source``-dtype tensors to ``target`` in calls that mix float16 and
    float32 tensors."""

    def __init__(self, source: torch.dtype, target: torch.dtype) -> None:
        super().__init__()
        self.source, self.target = source, target

    def _cast(self, value: object) -> object:
        if isinstance(value, torch.Tensor):
            return value.to(self.target) if value.dtype == self.source else value
        if isinstance(value, (list, tuple)):
            cast = [self._cast(v) for v in value]
            return type(value)(cast) if type(value) in (list, tuple) else value
        return value

    def __torch_function__(self, func: Callable[..., object], types: Collection[type],
                           args: tuple[object, ...] = (),
                           kwargs: dict[str, object] | None = None) -> object:
        kwargs = kwargs or {}
        if func not in _NEVER_CAST and not _writes_in_place(func, kwargs):
            found: set = set()
            _float_dtypes(args, found)
            _float_dtypes(kwargs.values(), found)
            if torch.float16 in found and torch.float32 in found:
                args = tuple(self._cast(a) for a in args)
                kwargs = {k: self._cast(v) for k, v in kwargs.items()}
        return func(*args, **kwargs)


def _casting_mode(behaviour: HalfFloatCastingBehavior) -> TorchFunctionMode | None:
    if behaviour == HalfFloatCastingBehavior.FloatDowncastToHalf:
        return _MixedPrecisionCasting(torch.float32, torch.float16)
    if behaviour == HalfFloatCastingBehavior.HalfUpcastToFloat:
        return _MixedPrecisionCasting(torch.float16, torch.float32)
    return None  # Default: PyTorch's own type promotion


# --------------------------------------------------------------------------------------
# Running statistics in float32


class _FloatAffine:
    """Temporarily replaces a module's low-precision ``weight``/``bias`` by float32
    casts (autograd flows back to the parameters through the casts)."""

    def __init__(self, module: torch.nn.Module) -> None:
        # the module's own parameter table: a float32 copy is swapped in for the call
        self.params = cast("dict[str, torch.Tensor | None]", module._parameters)
        self.saved: dict = {}

    def __enter__(self) -> None:
        for name in ("weight", "bias"):
            p = self.params.get(name)
            if p is not None and p.dtype != torch.float32:
                self.saved[name] = p
                self.params[name] = p.float()

    def __exit__(self, *exc: object) -> None:
        self.params.update(self.saved)
        self.saved = {}


def _float_statistics_forward(module: torch.nn.Module) -> Callable[..., torch.Tensor]:
    cls_forward = type(module).forward

    def forward(input: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        if input.dtype == torch.float32 and not any(
                p is not None and p.dtype != torch.float32
                for p in (module.weight, module.bias)):
            return cls_forward(module, input, *args, **kwargs)
        with _FloatAffine(module):
            out = cls_forward(module, input.float(), *args, **kwargs)
        return out.to(input.dtype)

    return forward


def _keep_statistics_float(model: torch.nn.Module) -> list[str]:
    """Convert low-precision running statistics to float32 (same tensor objects, so
    they stay shared) and make those layers compute in float32. Returns their names."""
    adapted = []
    for name, module in model.named_modules():
        if not isinstance(module, NormBase):
            continue
        stats = [module.running_mean, module.running_var]
        weights = [module.weight, module.bias]
        low = [t for t in stats + weights if t is not None and t.dtype in _LOW_PRECISION]
        if not low or module.running_mean is None:
            continue
        for stat in stats:
            if stat is not None and stat.dtype != torch.float32:
                stat.data = stat.data.float()
        module.forward = _float_statistics_forward(module)
        adapted.append(name or type(module).__name__)
    return adapted


# --------------------------------------------------------------------------------------
# Partials type


class _CudaHalfPartials:
    """Lets cuBLAS accumulate float16 (and bfloat16) matrix products in low precision."""

    _FLAGS = ("allow_fp16_accumulation", "allow_fp16_reduced_precision_reduction",
              "allow_bf16_reduced_precision_reduction")

    def __init__(self) -> None:
        self.saved: dict = {}

    def __enter__(self) -> None:
        matmul = torch.backends.cuda.matmul
        for flag in self._FLAGS:
            if hasattr(matmul, flag):
                self.saved[flag] = getattr(matmul, flag)
                setattr(matmul, flag, True)

    def __exit__(self, *exc: object) -> None:
        matmul = torch.backends.cuda.matmul
        for flag, value in self.saved.items():
            setattr(matmul, flag, value)
        self.saved = {}


# --------------------------------------------------------------------------------------


class PrecisionPolicy:
    """Applies ``Options.Precision`` (as compiled: ``config.PrecisionConfig``) to one
    compiled model (see module docstring).

    ``active`` is False when entering the policy would do nothing (every option that
    acts per call is at its default): callers may then skip ``with policy:``.
    ``checks_finite`` is True when :meth:`check_step` must run after every step.
    """

    def __init__(self, precision: PrecisionConfig, model: torch.nn.Module,
                 training: bool, device: torch.device) -> None:
        self.device = torch.device(device)
        self.training = training
        self.half_float_casting = HalfFloatCastingBehavior(precision.half_float_casting)
        self.partials_type = precision.partials_type
        self.stochastic_rounding = bool(precision.stochastic_rounding)
        self.checks_finite = bool(precision.floating_point_exceptions)
        self._param_names = {id(p): n for n, p in model.named_parameters()}
        self._contexts: list = []
        mode = _casting_mode(self.half_float_casting)
        if mode is not None:
            self._contexts.append(mode)
        if self.partials_type == torch.float16:
            if self.device.type == "cuda":
                self._contexts.append(_CudaHalfPartials())
            else:
                _logging.info_once(
                    ("Precision.setPartialsType", self.device.type),
                    "Precision.setPartialsType(torch.half): on an IPU matmul and "
                    "convolution partial results are kept in float16; on %s devices it "
                    "has no effect (recorded only): products accumulate in float32.",
                    self.device.type)
        if self.stochastic_rounding and not training:
            _logging.info_once(
                "Precision.enableStochasticRounding.inference",
                "Precision.enableStochasticRounding applies to the weight update of "
                "float16/bfloat16 parameters; an inference model has none.")
        self.float_statistics = []
        if precision.running_statistics_always_float:
            self.float_statistics = _keep_statistics_float(model)
        self.active = bool(self._contexts)
        self._entered: list = []

    # --- per call -----------------------------------------------------------------
    def __enter__(self) -> None:
        if not self.active:
            return
        entered = []
        try:
            for ctx in self._contexts:
                ctx.__enter__()
                entered.append(ctx)
        except BaseException:
            for ctx in reversed(entered):
                ctx.__exit__(None, None, None)
            raise
        self._entered.append(entered)

    def __exit__(self, *exc: object) -> None:
        if not self.active or not self._entered:
            return
        for ctx in reversed(self._entered.pop()):
            ctx.__exit__(*exc)

    def thread_context(self) -> contextlib.AbstractContextManager:
        """The thread-local part of the policy (the casting mode) for a worker thread
        that runs part of the program (a pipeline stage): torch function modes do not
        follow a call into other threads. A no-op context when casting is ``Default``."""
        mode = _casting_mode(self.half_float_casting)
        return mode if mode is not None else contextlib.nullcontext()

    # --- floating point exceptions --------------------------------------------------
    def check_step(self, outputs: UserOutput, params: NamedTensors | None) -> None:
        """Raise :class:`poptorch.Error` if an output or a parameter holds inf or NaN.

        ``params`` is a mapping or iterable of ``(name, tensor)`` pairs, or an
        iterable of parameters (named from the model given at construction).
        """
        if not self.checks_finite:
            return
        leaves, _ = pytree.tree_flatten(outputs)
        paths = _output_paths(outputs, len(leaves))
        checked = [(f"output {path}", t) for path, t in zip(paths, leaves, strict=False)
                   if isinstance(t, torch.Tensor) and t.is_floating_point()]
        checked += [(f"parameter {name!r}", t) for name, t in self._named(params)
                     if t.is_floating_point()]
        if not checked:
            return
        flags: dict = {}  # one stack and one host transfer per device
        for i, (_, t) in enumerate(checked):
            flags.setdefault(t.device, []).append((i, torch.isfinite(t).all()))
        finite = [True] * len(checked)
        for pairs in flags.values():
            for (i, _), ok in zip(pairs, torch.stack([f for _, f in pairs]).tolist(), strict=False):
                finite[i] = ok
        if all(finite):
            return
        bad = []
        for (what, t), ok in zip(checked, finite, strict=False):
            if not ok:
                kinds = []
                if bool(torch.isnan(t).any()):
                    kinds.append("NaN (invalid operation)")
                if bool(torch.isinf(t).any()):
                    kinds.append("inf (overflow or division by zero)")
                bad.append(f"{what} holds {' and '.join(kinds)}")
        raise Error("Floating point exception (Precision.enableFloatingPointExceptions "
                    "is set): " + "; ".join(bad) + ". Check the learning rate and loss "
                    "scaling, or compute the failing operation in float32.")

    def _named(self, params: NamedTensors | None) -> list[tuple[str, torch.Tensor]]:
        if params is None:
            return []
        items = params.items() if isinstance(params, Mapping) else params
        named = []
        for i, item in enumerate(items):
            if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str):
                named.append(item)
            elif isinstance(item, torch.Tensor):
                named.append((self._param_names.get(id(item), str(i)), item))
            else:
                raise TypeError(f"check_step: params must hold tensors or (name, tensor) "
                                f"pairs, got {type(item).__name__}.")
        return named

    # --- stochastic rounding ------------------------------------------------------
    def prepare_optimizer(self, optimizer: object) -> None:
        """Make ``optimizer`` round the update of float16/bfloat16 parameters
        stochastically when ``enableStochasticRounding`` is set (and not otherwise)."""
        if optimizer is None:
            return
        if not self.stochastic_rounding:
            if getattr(optimizer, _SR_FLAG, False):
                setattr(optimizer, _SR_FLAG, False)
            return
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise Error(f"Precision.enableStochasticRounding needs a torch.optim.Optimizer "
                        f"(or poptorch.optim), not {type(optimizer).__name__}.")
        setattr(optimizer, _SR_FLAG, True)
        _install_sr_hooks(optimizer)


def _output_paths(outputs: UserOutput, count: int) -> list[str]:
    """Readable positions of the flattened outputs: ``0``, ``1``, ``['loss']``..."""
    if isinstance(outputs, torch.Tensor):
        return ["0"]
    try:
        flat, _ = pytree.tree_flatten_with_path(outputs)
        return [pytree.keystr(path) or "0" for path, _ in flat]
    except (AttributeError, TypeError):
        return [str(i) for i in range(count)]
