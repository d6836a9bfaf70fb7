"""The device view of a ``poptorch.optim`` optimizer in its state dictionary.

PopTorch's ``optimizer.state_dict()`` carries two extra entries once a model using the
optimizer has been compiled: ``ipu_state`` (the optimizer state tensors on the device)
and ``ipu_param`` (the hyperparameters as the device holds them), both flat
``{name: tensor}`` dictionaries; before compilation both are ``None``. Loading a state
dictionary with them writes the given entries to the device before the next run and
leaves the missing ones as they are.

Our names: ``ipu_state["<state key>___<parameter index>"]`` (the index counts the
parameters of all param groups in order; the keys are those of torch's per-parameter
state, e.g. ``exp_avg``), ``ipu_param["<hyperparameter>___group<i>"]`` for param-group
hyperparameters and ``ipu_param["<attribute>"]`` for optimizer-level ones. Only numbers
appear (flags and dtypes fix the compiled program and are not device values);
hyperparameters are float64 tensors so that a round trip keeps Python's values exactly.
A state tensor that does not exist yet shows its initial value. A replica-grouped
parameter (``replicaGrouping``) has one value per group of every state tensor: its state
tensors have the parameter's leading group dimension, and its step count is shown once
per group (``[groups]``), as on PopTorch.
"""
from __future__ import annotations

import torch

from .attributes import PoptorchOptimizer

IpuView = tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]


def _params(optimizer: PoptorchOptimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _is_number(value: object) -> bool:
    if isinstance(value, bool):
        return False
    if isinstance(value, (int, float)):
        return True
    return isinstance(value, (tuple, list)) and bool(value) and all(
        isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)


def ipu_view(optimizer: PoptorchOptimizer) -> IpuView:
    """``(ipu_state, ipu_param)`` of an optimizer whose model is compiled."""
    state: dict[str, torch.Tensor] = {}
    grouped: dict[int, int] = getattr(optimizer, "_grouped_params", {})
    for index, p in enumerate(_params(optimizer)):
        current = optimizer.state.get(p, {})
        groups = grouped.get(index)
        for key, initial in optimizer._initial_state(p).items():
            value = current.get(key)
            if not isinstance(value, torch.Tensor):
                value = initial if value is None else torch.tensor(float(value))
            if groups is not None and value.dim() == 0:
                value = value.expand(groups)  # (every group takes the same steps)
            state[f"{key}___{index}"] = value.detach().clone()
    param: dict[str, torch.Tensor] = {}
    for i, group in enumerate(optimizer.param_groups):
        for name in optimizer._group_attrs:
            if _is_number(group.get(name)):
                param[f"{name}___group{i}"] = torch.tensor(group[name], dtype=torch.float64)
    for name in optimizer._optimizer_attrs:
        value = getattr(optimizer, name, None)
        if _is_number(value):
            param[name] = torch.tensor(value, dtype=torch.float64)
    return state, param


def load_ipu_view(optimizer: PoptorchOptimizer, ipu_state: dict[str, torch.Tensor] | None,
                  ipu_param: dict[str, torch.Tensor] | None) -> None:
    """Write the entries of a loaded ``ipu_state`` / ``ipu_param`` into the optimizer
    (raises ``poptorch.Error`` naming an unknown entry)."""
    from ..errors import Error
    params = _params(optimizer)
    for name, value in (ipu_state or {}).items():
        key, _, index = name.rpartition("___")
        if not index.isdigit() or int(index) >= len(params):
            raise Error(f"load_state_dict: unknown ipu_state entry {name!r}; entries are "
                        f"named '<state key>___<parameter index>'.")
        p = params[int(index)]
        initial = optimizer._initial_state(p)
        if key not in initial:
            raise Error(f"load_state_dict: {type(optimizer).__name__} has no state "
                        f"{key!r} (ipu_state entry {name!r}); its state keys are "
                        f"{', '.join(initial)}.")
        if initial[key].dim() == 0 and value.dim() == 1:
            value = value[0]  # a replica-grouped parameter's step, one per group
        optimizer.state[p][key] = value.detach().to(
            device=p.device, dtype=initial[key].dtype, copy=True)
    for name, value in (ipu_param or {}).items():
        attr, _, group = name.rpartition("___group")
        number = value.tolist() if isinstance(value, torch.Tensor) else value
        if attr and group.isdigit() and int(group) < len(optimizer.param_groups):
            g = optimizer.param_groups[int(group)]
            g[attr] = tuple(number) if isinstance(g.get(attr), tuple) else number
        elif name in optimizer._optimizer_attrs:
            setattr(optimizer, name, number)
        else:
            raise Error(f"load_state_dict: unknown ipu_param entry {name!r}.")
