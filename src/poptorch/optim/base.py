"""The ``poptorch.optim.Optimizer`` mixin: PopTorch's extra optimizer attributes,
their per-param-group rules, state dtypes and the state dictionary.

A concrete optimizer declares three attribute tables (class attributes):

* ``_group_attrs``: ``{name: default}`` hyperparameters stored in each param group
  (torch's hyperparameters, plus ``velocity_scaling`` for SGD); a param group may
  override them.
* ``_optimizer_attrs``: ``{name: default}`` attributes of the whole optimizer
  (``loss_scaling``, ``max_grad_norm``, ...); they must be the same for every param
  group, so setting one in a param group is an error.
* ``_structural_attrs``: ``{name: default}`` state dtypes and the SGD variant: like
  optimizer attributes, but always constant.

Arguments left at ``None`` take the default and are constant; arguments passed
explicitly are variable (see ``poptorch.optim.attributes``).
"""
from __future__ import annotations

import copy
from collections import defaultdict
from collections.abc import Callable
from typing import TYPE_CHECKING, ClassVar, TypeVar, cast

import torch

from .._logging import info_once
from .._runtime.numerics.loss_scaling import PENDING_UNSCALE_ATTR
from .._runtime.numerics.precision import stochastic_round, stochastic_rounding_active
from .._typing import ParamGroup, StateDict, StateValue
from ..errors import Error, PoptorchAssertionError, PoptorchRuntimeError
from .attributes import VariableAttributes

if TYPE_CHECKING:
    from torch.optim.optimizer import ParamsT

ACCUM_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_STATE_KEY = "poptorch"

T = TypeVar("T")
# PopTorch attribute name -> its default value (of the attribute's own type)
AttrDefaults = dict[str, object]
# one parameter's optimizer state: "step" and the state tensors
ParamState = dict[str, StateValue]


def _log_once_info(message: str) -> None:
    info_once(("poptorch.optim", message), "%s", message)


def resolve(value: T | None, default: T) -> T:
    """``None`` means "use the default"."""
    return default if value is None else value


class Optimizer:
    """Mixin giving ``poptorch.optim`` optimizers PopTorch's attributes and state handling.

    ``host_state_is_dirty`` is set by the executor when the optimizer state on the
    device has moved on (``state_dict()`` then reads it back); ``ipu_state_is_dirty``
    is set by ``load_state_dict`` so the executor sends the new state to the device
    before the next run.
    """

    # precision.LOW_PRECISION_AWARE_ATTR: this class unscales and rounds its own updates
    _poptorch_low_precision_aware = True
    _group_attrs: ClassVar[AttrDefaults] = {}
    _optimizer_attrs: ClassVar[AttrDefaults] = {}
    _structural_attrs: ClassVar[AttrDefaults] = {}
    # Set by torch.optim.Optimizer, the other base of every concrete class.
    defaults: ParamGroup
    param_groups: list[ParamGroup]
    state: defaultdict[torch.Tensor, ParamState]
    variable_attrs: VariableAttributes
    _explicit: set
    # PopTorch's attributes, set by _finish from _optimizer_attrs / _structural_attrs
    # (each concrete class has some of them).
    loss_scaling: float
    max_grad_norm: float
    use_combined_accum: bool
    accum_type: torch.dtype
    velocity_accum_type: torch.dtype
    first_order_momentum_accum_type: torch.dtype
    second_order_momentum_accum_type: torch.dtype
    use_tf_variant: bool
    bias_correction: bool
    # Each state tensor of a parameter before its first step (ipu_state): every concrete
    # class defines it.
    _initial_state: Callable[[torch.Tensor], dict[str, torch.Tensor]]

    def __init__(self) -> None:
        self.host_state_is_dirty = False
        self.ipu_state_is_dirty = False
        # Set by the executor: returns the device optimizer's state dictionary.
        self._device_state_reader: Callable[[], StateDict] | None = None
        # Top-level state-dict entries added by others (e.g. the loss scaler).
        self._extra_state: StateDict = {}
        # Set by the executor when a model using this optimizer is compiled for a
        # device: state_dict() then shows the device view (ipu_state / ipu_param).
        self._compiled_on_device = False
        # {parameter index: number of groups} of the replica-grouped parameters there
        self._grouped_params: dict[int, int] = {}
        # ipu_state / ipu_param as last loaded, shown until the next step uses them.
        self._loaded_ipu: tuple[StateValue, StateValue] | None = None

    # --- pickling (torch.save of a model with its optimizer, poptorch.load) --------
    def __getstate__(self) -> dict[str, object]:
        """torch keeps only defaults, state and param_groups; PopTorch's attributes
        (loss_scaling, accumulator types, ...) travel too. Hooks and the device reader
        belong to this process and are left out, as torch leaves out its hooks."""
        state = super().__getstate__()  # type: ignore[misc]  # (a mixin: torch.optim.Optimizer, the other base, has it)
        for key, value in self.__dict__.items():
            if key not in state and not key.startswith("_optimizer_") \
                    and key != "_device_state_reader" and not self._patched_method(key):
                state[key] = value
        return state

    def _patched_method(self, key: str) -> bool:
        """An instance attribute over a method of the class, such as the ``step`` an LR
        scheduler wraps: it belongs to this process (a scheduler wraps the step again
        after loading), and torch leaves it out too."""
        return callable(getattr(type(self), key, None)) and callable(self.__dict__[key])

    def __setstate__(self, state: dict[str, object]) -> None:
        super().__setstate__(state)  # type: ignore[misc]  # (as above)
        self.__dict__.setdefault("host_state_is_dirty", False)
        self.__dict__.setdefault("ipu_state_is_dirty", False)
        self.__dict__.setdefault("_extra_state", {})
        self._device_state_reader = None

    # --- construction helpers ---------------------------------------------------
    def _prepare(self, params: ParamsT, passed: dict[str, object]
                 ) -> tuple[ParamsT, ParamGroup]:
        """Validate param groups and explicit arguments before torch's __init__.

        Returns the materialised params and the resolved group hyperparameters.
        """
        params = cast("ParamsT", list(params) if not isinstance(params, torch.Tensor)
                      else [params])
        group_keys = set()
        for group in params:
            if isinstance(group, dict):
                for key in group:
                    if key in self._optimizer_attrs or key in self._structural_attrs:
                        raise Error(
                            f"{type(self).__name__}: {key!r} must have the same value "
                            f"for every param group; pass it to the optimizer "
                            f"constructor instead of setting it in a param group.")
                    group_keys.add(key)
        if passed.get("differentiable"):
            raise Error(f"poptorch.optim.{type(self).__name__} does not support "
                        f"differentiable=True: the update runs without autograd.")
        for name, value in passed.items():
            if name in self._structural_attrs and value is not None:
                self._check_structural(name, value)
        resolved = {name: resolve(passed.get(name), default)
                    for name, default in self._group_attrs.items()}
        self._explicit = {name for name, value in passed.items() if value is not None}
        self._explicit |= group_keys & set(self._group_attrs)
        return params, resolved

    def _finish(self, passed: dict[str, object]) -> None:
        """Set optimizer-level attributes and ``variable_attrs`` after torch's __init__."""
        Optimizer.__init__(self)
        for name, default in {**self._optimizer_attrs, **self._structural_attrs}.items():
            setattr(self, name, resolve(passed.get(name), default))
        for name, default in self._group_attrs.items():
            self.defaults.setdefault(name, default if passed.get(name) is None
                                     else passed[name])
            for group in self.param_groups:
                group.setdefault(name, self.defaults[name])
        allowed = (*self._group_attrs, *self._optimizer_attrs)
        self.variable_attrs = VariableAttributes(
            sorted(self._explicit & set(allowed)), allowed)
        for flag in ("foreach", "fused", "capturable"):
            if passed.get(flag):
                _log_once_info(f"poptorch.optim.{type(self).__name__}: {flag}=True is "
                               f"recorded but has no effect; the update is always "
                               f"computed per tensor in PopTorch's formulation.")

    def _check_structural(self, name: str, value: object) -> None:
        if name.endswith("_type") and value not in ACCUM_DTYPES:  # upstream: an assert
            raise PoptorchAssertionError(
                f"{type(self).__name__}: {name}={value!r} is not supported; use one of "
                f"{', '.join(str(d) for d in ACCUM_DTYPES)}.")
        if name == "use_combined_accum" and not isinstance(value, bool):
            raise Error(f"{type(self).__name__}: use_combined_accum must be a bool, "
                        f"got {value!r}.")

    # --- gradients ----------------------------------------------------------------
    #: Applied to what :py:meth:`_gradients` returns, for one step, when set: the
    #: sharded optimizer state of ``_runtime/memory/sharding.py`` clips by the norm of
    #: the whole model's gradients, which no shard sees.
    gradient_override: (Callable[[dict[torch.Tensor, torch.Tensor]],
                                 dict[torch.Tensor, torch.Tensor]] | None) = None

    def _gradients(self) -> dict[torch.Tensor, torch.Tensor]:
        """Each parameter's gradient in the accumulator dtype, unscaled and clipped,
        returned in the compute dtype (float32, or wider if the parameter is)."""
        grads = self._own_gradients()
        if self.gradient_override is not None:
            grads = self.gradient_override(grads)
        return grads

    def _own_gradients(self) -> dict[torch.Tensor, torch.Tensor]:
        accum = getattr(self, "accum_type", torch.float32)
        grads: dict[torch.Tensor, torch.Tensor] = {}
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise Error(f"{type(self).__name__} does not support sparse "
                                f"gradients.")
                g = p.grad.to(compute_dtype(p))
                # LossScaler leaves low-precision gradients scaled (see
                # _runtime/numerics/loss_scaling.py): divide them here, in the wider dtype.
                divisor = getattr(p.grad, PENDING_UNSCALE_ATTR, None)
                if divisor is not None:
                    g = g / divisor
                grads[p] = g.to(accum).to(compute_dtype(p))
        if self._loaded_ipu is not None:  # a step moves the device state on (written
            self._loaded_ipu = None  # only when set: a compiled update writes no attribute)
        max_norm = getattr(self, "max_grad_norm", float("inf"))
        if grads and max_norm != float("inf"):
            norms = torch.stack([torch.linalg.vector_norm(g.float()) for g in grads.values()])
            total = torch.linalg.vector_norm(norms)
            coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
            grads = {p: g * coef.to(g.dtype) for p, g in grads.items()}
        return grads

    # --- state dictionary ---------------------------------------------------------
    def get_state_dict(self) -> StateDict:
        """The host copy of the state dictionary (without reading from the device)."""
        state = torch.optim.Optimizer.state_dict(cast(torch.optim.Optimizer, self))
        for key, value in self._extra_state.items():
            state.setdefault(key, value)
        state[_STATE_KEY] = {name: copy.deepcopy(getattr(self, name))
                             for name in (*self._optimizer_attrs, *self._structural_attrs)}
        return state

    def set_state_dict(self, state: StateDict) -> None:
        """Replace the host copy of the state (the device copy is not marked dirty)."""
        state = dict(state)
        attrs = state.pop(_STATE_KEY, {})
        state.pop("ipu_state", None)
        state.pop("ipu_param", None)
        torch.optim.Optimizer.load_state_dict(cast(torch.optim.Optimizer, self), state)
        self._restore_state_dtypes(state)
        for name, value in attrs.items():
            if name in self._optimizer_attrs or name in self._structural_attrs:
                setattr(self, name, copy.deepcopy(value))
        self._extra_state = {k: copy.deepcopy(v) for k, v in state.items()
                             if k not in ("state", "param_groups")}
        self.host_state_is_dirty = False

    def has_state(self) -> bool:
        """True if the optimizer holds state (on the host or on the device)."""
        return bool(self.state) or self.host_state_is_dirty

    def state_dict(self) -> StateDict:
        """The state dictionary, read from the device first if it moved on there."""
        if self.host_state_is_dirty and self._device_state_reader is not None:
            self.set_state_dict(self._device_state_reader())
        state = self.get_state_dict()
        from .ipu_state import ipu_view
        if self._loaded_ipu is not None:
            ipu_state, ipu_param = (dict(d) if d is not None else None
                                    for d in self._loaded_ipu)
        elif getattr(self, "_compiled_on_device", False):
            ipu_state, ipu_param = ipu_view(self)
        else:
            ipu_state = ipu_param = None
        state["ipu_state"], state["ipu_param"] = ipu_state, ipu_param
        return state

    def load_state_dict(self, state: StateDict) -> None:
        """Load a state dictionary from ``state_dict()``; a model using this optimizer
        receives it before its next run."""
        if not isinstance(state, dict) or "state" not in state or "param_groups" not in state:
            # upstream: RuntimeError for a state it cannot load (set_state_dict)
            raise PoptorchRuntimeError("load_state_dict expects a dictionary returned by a "
                                       "poptorch optimizer's state_dict().")
        self.set_state_dict(state)
        ipu_state, ipu_param = state.get("ipu_state"), state.get("ipu_param")
        if ipu_state is not None or ipu_param is not None:
            from .ipu_state import load_ipu_view
            load_ipu_view(self, ipu_state, ipu_param)
            self._loaded_ipu = (ipu_state, ipu_param)
        self.ipu_state_is_dirty = True

    def _restore_state_dtypes(self, state: StateDict) -> None:
        """torch's load_state_dict casts state to the parameter dtype; PopTorch keeps
        the accumulator dtypes, so put back the saved tensors' dtypes (and values)."""
        saved_ids = [i for g in state["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for saved_id, p in zip(saved_ids, params, strict=False):
            for key, value in state["state"].get(saved_id, {}).items():
                if isinstance(value, torch.Tensor) and key != "step":
                    self.state[p][key] = value.detach().to(device=p.device, copy=True)

    # --- state tensors --------------------------------------------------------------
    @staticmethod
    def _store(state: ParamState, key: str, value: torch.Tensor,
               dtype: torch.dtype) -> torch.Tensor:
        """Keep ``value`` as optimizer state ``key`` in ``dtype``; return the stored
        value in ``value``'s dtype (rounded through ``dtype``), which the update uses."""
        old = state.get(key)
        if old is not None and old.dtype == dtype and old.shape == value.shape:
            old.copy_(value)
        else:
            state[key] = value.detach().to(dtype=dtype, copy=True)
        return value if dtype == value.dtype else state[key].to(value.dtype)

    @staticmethod
    def _next_step(state: ParamState) -> float | torch.Tensor:
        """Count a step in ``state["step"]``; return the count: a float eagerly; while
        ``torch.compile`` traces the update, the tensor itself (as torch.optim's
        ``_get_value``: a graph value, no ``.item()`` graph break) in float64, so that
        the bias corrections round as the eager floats do."""
        step = state.get("step")
        if step is None:
            step = state["step"] = torch.tensor(0.0, dtype=torch.float32)
        step += 1
        if torch.compiler.is_compiling():
            return step.to(torch.float64)
        return float(step.item())


def compute_dtype(p: torch.Tensor) -> torch.dtype:
    """Update arithmetic runs in float32, or in the parameter dtype if it is wider."""
    return torch.promote_types(p.dtype, torch.float32)


def apply_to_param(p: torch.Tensor, update: Callable[[torch.Tensor], object]) -> None:
    """Run the in-place ``update`` on ``p`` in the compute dtype; a narrower ``p`` is
    written back rounded to nearest, or stochastically under
    ``Precision.enableStochasticRounding`` (see ``_runtime/numerics/precision.py``)."""
    if p.dtype == compute_dtype(p):
        update(p)
    else:
        wide = p.to(compute_dtype(p))
        update(wide)
        p.copy_(stochastic_round(wide, p.dtype) if stochastic_rounding_active() else wide)


def state_view(state: ParamState, key: str, like: torch.Tensor,
               fill: float = 0.0) -> torch.Tensor:
    """The state tensor ``key`` in the compute dtype (a new tensor; store it back)."""
    value = state.get(key)
    if value is None:
        return torch.full_like(like, fill, dtype=compute_dtype(like),
                               memory_format=torch.preserve_format)
    return value.to(compute_dtype(like), copy=True)

