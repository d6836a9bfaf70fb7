"""Anchored tensors: model tensors that are not outputs, recorded after device iterations.

``Options.anchorTensor(short_name, long_name, output_mode, output_return_period)`` names a
tensor of ``PoplarExecutor.getTensorNames()``: a parameter (its value after the
iteration, i.e. the updated weight in training), ``Gradient___<parameter>`` (the reduced,
unscaled gradient of the iteration's optimizer step), ``UpdatedVar___<parameter>``
(PopTorch's name of the weight after the update; training only) or a buffer (replica
0's copy).

The program calls the recorder after every device iteration ``i``; what is kept follows
the anchor's output mode (``None``: the model's, with ``Default`` resolved as for
outputs): ``Final`` keeps the last iteration's value, ``All`` stacks every iteration's
(shape ``[d, *tensor.shape]``), ``EveryN`` stacks iterations ``N-1, 2N-1, ...`` and
``Sum`` adds them up. Values are returned on the host.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from ...enums import OutputMode
from ...errors import Error, PoptorchAssertionError
from ..config import RuntimeConfig
from .plan import BatchPlan, resolve_output_mode

GRADIENT_PREFIX = "Gradient___"
UPDATED_PREFIX = "UpdatedVar___"


def tensor_names(model: torch.nn.Module, training: bool) -> list[str]:
    """Anchorable names: parameters, their gradients (training only), buffers."""
    names = [n for n, _ in model.named_parameters()]
    grads = [GRADIENT_PREFIX + n for n in names] if training else []
    updated = [UPDATED_PREFIX + n for n in names] if training else []
    return names + grads + updated + [n for n, _ in model.named_buffers()]


def _reader(model: torch.nn.Module, long_name: str,
            training: bool) -> Callable[[], torch.Tensor | None]:
    params = dict(model.named_parameters())
    if training and long_name.startswith(GRADIENT_PREFIX) and \
            long_name[len(GRADIENT_PREFIX):] in params:
        param = params[long_name[len(GRADIENT_PREFIX):]]
        return lambda: param.grad
    if training and long_name.startswith(UPDATED_PREFIX) and \
            long_name[len(UPDATED_PREFIX):] in params:
        long_name = long_name[len(UPDATED_PREFIX):]  # the weight after the update
    if long_name in params:
        param = params[long_name]
        return lambda: param
    module_name, _, buffer_name = long_name.rpartition(".")
    try:
        module = model.get_submodule(module_name)
    except AttributeError:
        module = None
    if module is not None and buffer_name in module._buffers:
        return lambda: module._buffers[buffer_name]  # follows buffers reassigned in forward
    raise Error(f"anchorTensor: no tensor named {long_name!r} in this "
                f"{'training' if training else 'inference'} model. Valid names "
                f"(getTensorNames()): {', '.join(tensor_names(model, training))}.")


class _Anchor:
    """What one anchor keeps over the iterations of a call."""

    def __init__(self, read: Callable[[], torch.Tensor | None], mode: OutputMode,
                 period: int, iterations: int, short_name: str) -> None:
        self.read, self.mode, self.period = read, mode, period
        self.last = iterations - 1
        if mode == OutputMode.EveryN and iterations % period:
            raise Error(f"anchorTensor {short_name!r}: OutputMode.EveryN with "
                        f"output_return_period={period} needs deviceIterations "
                        f"({iterations}) to be a multiple of the period.")
        self.kept: list[torch.Tensor] = []
        self.total: torch.Tensor | None = None

    def wants(self, i: int) -> bool:
        mode = self.mode
        if mode == OutputMode.Final:
            return i == self.last
        if mode == OutputMode.EveryN:
            return (i + 1) % self.period == 0
        return True

    def record(self, i: int) -> None:
        if i == 0:
            self.kept, self.total = [], None
        if not self.wants(i):
            return
        value = self.read()
        if value is None:  # e.g. a gradient of a parameter the loss does not use
            return
        value = value.detach().clone()
        if self.mode == OutputMode.Sum:
            self.total = value if self.total is None else self.total + value
        else:
            self.kept.append(value)

    def value(self) -> torch.Tensor | None:
        if self.mode == OutputMode.Sum:
            return self.total
        if not self.kept:
            return None
        if self.mode == OutputMode.Final:
            return self.kept[-1]
        return torch.stack(self.kept)


class AnchorRecorder:
    """Records the anchored tensors of a compiled model (see module docstring)."""

    def __init__(self, model: torch.nn.Module, config: RuntimeConfig, plan: BatchPlan,
                 training: bool) -> None:
        self._anchors: dict[str, _Anchor] = {}
        for short, spec in config.anchored_tensors.items():
            mode = spec["output_mode"]
            mode = resolve_output_mode(config.output_mode if mode is None else mode,
                                       training)
            period = spec["output_return_period"]
            if spec["output_mode"] is None and mode == OutputMode.EveryN:
                period = config.output_return_period
            self._anchors[short] = _Anchor(_reader(model, spec["long_name"], training),
                                           mode, period, plan.device_iterations, short)

    def __bool__(self) -> bool:
        return bool(self._anchors)

    def __call__(self, iteration: int) -> None:
        for anchor in self._anchors.values():
            anchor.record(iteration)

    def get(self, short_name: str) -> torch.Tensor:
        """The value of anchor ``short_name`` from the last call, on the host."""
        anchor = self._anchors.get(short_name)
        if anchor is None:
            raise PoptorchAssertionError(  # (upstream asserts the name is anchored)
                f"getAnchoredTensor: no tensor is anchored as {short_name!r}; "
                f"anchored: {', '.join(sorted(self._anchors))}.")
        value = anchor.value()
        if value is None:
            raise Error(f"getAnchoredTensor: {short_name!r} has no value yet (run the "
                        "model first; a gradient is absent when the loss does not "
                        "depend on its parameter).")
        return value.cpu()
