"""The optimizer as the device program sees it.

On the CPU the device shares the user's parameters, so the user's optimizer object *is*
the device optimizer: its ``state_dict()`` shows the device state, as PopTorch's
documentation promises. On an accelerator a copy of it is made over the device
parameters. ``setOptimizer`` attaches a new optimizer and carries the device state
(momentum, ...) over, unless the new optimizer brings state of its own.
"""
from __future__ import annotations

import copy
from collections import defaultdict
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol, cast

import torch

from ..._typing import StateDict
from ...errors import Error
from ..config import RuntimeConfig
from ..torch_internals import step_needs_wrapper
from ..weights.sync import WeightSync

if TYPE_CHECKING:
    from ..numerics.loss_scaling import LossScaler


class DeviceStateView(Protocol):
    """What the engine reads and writes of a ``poptorch.optim`` optimizer
    (``optim/base.py``, above the engine): its state flags and its state."""
    host_state_is_dirty: bool
    ipu_state_is_dirty: bool
    _device_state_reader: Callable[[], StateDict] | None

    def get_state_dict(self) -> StateDict: ...

    def state_dict(self) -> StateDict: ...

    def load_state_dict(self, state_dict: StateDict) -> None: ...


AttributeKeys = tuple[frozenset, list[frozenset], set]
"""An optimizer's public attributes and each param group's keys at compile time, and the
attributes already warned about (``executor/optimizer_rules.attribute_keys``)."""


def _check_params(optimizer: object, user_model: torch.nn.Module) -> None:
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise Error(f"The optimizer must be a torch.optim.Optimizer (or poptorch.optim), "
                    f"not {type(optimizer).__name__}.")
    owned = {id(p) for p in user_model.parameters()}
    for i, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if id(p) not in owned:
                raise Error(
                    f"The optimizer's param_groups[{i}] holds a parameter of shape "
                    f"{tuple(p.shape)} that is not a parameter of the wrapped model: build "
                    "the optimizer from model.parameters() of the model you wrap.")


def attach_optimizer(optimizer: torch.optim.Optimizer, device_model: torch.nn.Module,
                     user_model: torch.nn.Module, sync: WeightSync,
                     previous: torch.optim.Optimizer | None = None) -> torch.optim.Optimizer:
    """Return the optimizer that steps the device parameters (see module docstring)."""
    _check_params(optimizer, user_model)
    carry_state = previous is not None and previous is not optimizer and not optimizer.state
    if sync.shared:
        if carry_state:
            assert previous is not None  # (carry_state says so)
            optimizer.state = previous.state
        return optimizer
    names = {id(p): n for n, p in user_model.named_parameters()}
    device_params = dict(device_model.named_parameters())
    mapping = {id(p): device_params[names[id(p)]] for p in user_model.parameters()}
    device_opt = copy.copy(optimizer)
    if hasattr(device_opt, "host_state_is_dirty"):  # poptorch.optim: the copy is the device
        view = cast(DeviceStateView, device_opt)
        view.host_state_is_dirty = view.ipu_state_is_dirty = False
        view._device_state_reader = None
    device_opt.param_groups = [dict(g, params=[mapping[id(p)] for p in g["params"]])
                               for g in optimizer.param_groups]
    if carry_state:
        assert previous is not None  # (carry_state says so)
        device_opt.state = previous.state
    else:
        device_opt.state = defaultdict(dict, {
            mapping[id(p)]: {k: v.to(sync.device) if isinstance(v, torch.Tensor) else v
                             for k, v in s.items()}
            for p, s in optimizer.state.items()})
    return device_opt


def make_loss_scaler(optimizer: torch.optim.Optimizer, config: RuntimeConfig,
                     previous: LossScaler | None = None) -> LossScaler | None:
    """A LossScaler when the optimizer scales the loss or automatic loss scaling is on;
    None otherwise (the common case costs nothing)."""
    automatic = config.training.automatic_loss_scaling
    scale = getattr(optimizer, "loss_scaling", None)
    if not automatic and (scale is None or float(scale) == 1.0):
        return None
    from ..numerics.loss_scaling import LossScaler
    scaler = LossScaler(optimizer, automatic)
    if automatic and previous is not None and getattr(previous, "automatic", False):
        state = previous.state_dict()
        if state["configured"] == scaler.state_dict()["configured"]:
            scaler.load_state_dict(state)  # same setting: keep the scale reached so far
    return scaler


class DeviceOptimizerSync:
    """Keeps a ``poptorch.optim`` optimizer's host view in step with its device copy
    (accelerators only; on the CPU the user's optimizer is the device optimizer).

    Before a run, state loaded into the user's optimizer (``ipu_state_is_dirty``) is sent
    to the device; after a run, the user's ``state_dict()`` is told to read the device
    state back (``host_state_is_dirty`` and ``_device_state_reader``).
    """

    def __init__(self, user_optimizer: DeviceStateView,
                 device_optimizer: DeviceStateView) -> None:
        self.user = user_optimizer
        self.device = device_optimizer

    @staticmethod
    def needed(user_optimizer: object, device_optimizer: object) -> bool:
        """Whether a sync is needed: a poptorch.optim optimizer with a device copy."""
        return device_optimizer is not user_optimizer and \
            hasattr(user_optimizer, "ipu_state_is_dirty")

    def before_run(self) -> None:
        user = self.user
        if user.ipu_state_is_dirty:
            self.device.load_state_dict(user.get_state_dict())
            self.device.ipu_state_is_dirty = False
            user.ipu_state_is_dirty = False

    def after_run(self) -> None:
        self.user.host_state_is_dirty = True
        self.user._device_state_reader = self.device.state_dict


def fast_step(optimizer: torch.optim.Optimizer) -> Callable[[], object]:
    """``optimizer.step`` without torch.optim's per-call wrapper when it has nothing to do.

    ``Optimizer.step`` is wrapped in a profiler range and a hook dispatcher that cost
    about 10 microseconds per call, as much as the whole update of a small model. The
    returned callable calls the unwrapped step while no step hook is registered and no
    profiler is running, and the full ``optimizer.step()`` otherwise: same results.
    """
    wrapped = optimizer.step
    inner = getattr(type(optimizer).step, "__wrapped__", None)
    if inner is None:
        return wrapped
    def step() -> object:
        if step_needs_wrapper(optimizer):
            return wrapped()
        return inner(optimizer)
    return step


class OptimizerBinding:
    """The optimizer a compiled training program steps, its loss scaler, and how it is
    kept in step with the user's optimizer: the one place that holds them.
    ``setOptimizer`` calls :py:meth:`bind`; ``keys`` and ``constants`` are those of the
    compile (PopTorch checks later optimizers against the compiled one)."""

    def __init__(self, device: torch.optim.Optimizer, sync: DeviceOptimizerSync | None,
                 keys: AttributeKeys, scaler: LossScaler | None = None) -> None:
        self.keys = keys  # the optimizer attributes known at compile time
        # their constant values (recorded after the compile)
        # (an ``optim.attributes.OptimizerSnapshot``: optim/ is above the engine)
        self.constants: object | None = None
        self.device = device
        self.sync = sync
        self.scaler = scaler
        self.step: Callable[[], object] = fast_step(device)
        self.version = 0  # counts the bindings (``bind``)

    def bind(self, device: torch.optim.Optimizer, sync: DeviceOptimizerSync | None,
             scaler: LossScaler | None) -> None:
        """Step ``device`` from the next call on (``setOptimizer``)."""
        self.device, self.sync, self.scaler = device, sync, scaler
        self.step = fast_step(device)
        self.version += 1
