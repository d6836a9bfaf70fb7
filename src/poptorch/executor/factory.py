"""``trainingModel`` and ``inferenceModel``, including the legacy positional form.

SDK 1.x programs call ``trainingModel(model, device_iterations, gradient_accumulation=1,
replication_factor=1, profile=False, trace_model=True, loss=None, optimizer=None)``; those
arguments are turned into :py:class:`poptorch.Options` here.
"""
from __future__ import annotations

import inspect
from collections.abc import Callable

import torch

from .._runtime.export import read_payload
from .._typing import UserInput, UserOutput
from .._version import __version__
from ..enums import ConnectionType
from ..errors import Error
from ..optim.optimizers import SGD
from ..options.options import Options
from .poplar_executor import PoplarExecutor

__all__ = ["inferenceModel", "load", "trainingModel"]

_VERSION = __version__


class _ModelWithLoss(torch.nn.Module):
    """Legacy ``loss=``: the last input is the label; returns ``(output, loss)``."""

    def __init__(self, model: torch.nn.Module, loss: torch.nn.Module) -> None:
        super().__init__()
        self.model = model
        self.loss = loss

    def forward(self, *args: UserInput) -> tuple[UserOutput, UserOutput]:
        if len(args) < 2:
            raise Error("A model wrapped with loss= takes the inputs and then the label as "
                        "its last argument: poptorch_model(inputs, label).")
        output = self.model(*args[:-1])
        return output, self.loss(output, args[-1])


_P = inspect.Parameter
_TRAINING = inspect.Signature([_P("model", _P.POSITIONAL_OR_KEYWORD),
                               _P("options", _P.POSITIONAL_OR_KEYWORD, default=None),
                               _P("optimizer", _P.POSITIONAL_OR_KEYWORD, default=None)])
_INFERENCE = inspect.Signature(list(_TRAINING.parameters.values())[:2])
_LEGACY_TRAINING = inspect.Signature(
    [_P("model", _P.POSITIONAL_OR_KEYWORD), _P("device_iterations", _P.POSITIONAL_OR_KEYWORD)]
    + [_P(n, _P.POSITIONAL_OR_KEYWORD, default=v) for n, v in (
        ("gradient_accumulation", 1), ("replication_factor", 1), ("profile", False),
        ("trace_model", True), ("loss", None), ("optimizer", None))])
_LEGACY_INFERENCE = inspect.Signature(
    [_P("model", _P.POSITIONAL_OR_KEYWORD)]
    + [_P(n, _P.POSITIONAL_OR_KEYWORD, default=v) for n, v in (
        ("device_iterations", 1), ("replication_factor", 1), ("profile", False),
        ("trace_model", True))])


def _bind(modern: inspect.Signature, legacy: inspect.Signature, args: tuple,
          kwargs: dict, fn: str) -> dict:
    """Bind a call to the modern form, or to the SDK 1.x form when it looks like one."""
    legacy_only = set(legacy.parameters) - set(modern.parameters)
    is_legacy = bool(legacy_only & set(kwargs)) or (
        len(args) > 1 and not (args[1] is None or isinstance(args[1], Options)))
    signature = legacy if is_legacy else modern
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError as e:
        raise TypeError(f"{fn}{signature}: {e}") from None
    bound.apply_defaults()
    values = dict(bound.arguments)
    values["legacy"] = is_legacy
    return values


def _legacy_options(values: dict) -> Options:
    opts = Options()
    opts.deviceIterations(int(values["device_iterations"]))
    opts.replicationFactor(int(values["replication_factor"]))
    if "gradient_accumulation" in values:
        opts.Training.gradientAccumulation(int(values["gradient_accumulation"]))
    if values["profile"]:
        opts.enableProfiling()
    opts.Jit.traceModel(bool(values["trace_model"]))
    return opts


def _unwrap(model: torch.nn.Module | PoplarExecutor) -> torch.nn.Module:
    """A PoplarExecutor may be wrapped again: the new wrapper shares its weights."""
    if isinstance(model, PoplarExecutor):
        return model.model  # (the user's module, with the device's weights)
    return model


def trainingModel(*args: object, **kwargs: object) -> PoplarExecutor:
    """trainingModel(model, options=None, optimizer=None)

    Wrap ``model`` for training: each call runs forward, backward and the optimizer
    update for a whole batch of micro-batches (see the batching guide). ``optimizer``
    defaults to ``poptorch.optim.SGD(lr=0.01)``. The wrapper shares the model's
    parameters: trained values show in ``model`` without explicit copies.

    The SDK 1.x form ``trainingModel(model, device_iterations, gradient_accumulation=1,
    replication_factor=1, profile=False, trace_model=True, loss=None, optimizer=None)``
    is accepted too; ``loss`` is a module applied as ``loss(model(*inputs), label)``.
    """
    values = _bind(_TRAINING, _LEGACY_TRAINING, args, kwargs, "trainingModel")
    options = _legacy_options(values) if values["legacy"] else values["options"]
    optimizer, loss = values["optimizer"], values.get("loss")
    model = user_model = _unwrap(values["model"])
    if loss is not None:
        if optimizer is None:
            optimizer = SGD(model.parameters(), lr=0.01)
        model = user_model = _ModelWithLoss(model, loss)
    return PoplarExecutor(model, options, True, _VERSION, optimizer, user_model)


def inferenceModel(*args: object, **kwargs: object) -> PoplarExecutor:
    """inferenceModel(model, options=None)

    Wrap ``model`` for inference: each call runs the forward pass on every micro-batch
    and returns the outputs the output mode asks for (all of them by default). The SDK
    1.x form ``inferenceModel(model, device_iterations=1, replication_factor=1,
    profile=False, trace_model=True)`` is accepted too.
    """
    values = _bind(_INFERENCE, _LEGACY_INFERENCE, args, kwargs, "inferenceModel")
    options = _legacy_options(values) if values["legacy"] else values["options"]
    model = _unwrap(values["model"])
    return PoplarExecutor(model, options, False, _VERSION, None, model)


# what help() and inspect show: the documented parameters, not (*args, **kwargs)
trainingModel.__signature__ = _TRAINING  # type: ignore[attr-defined]  # (a function attribute)
inferenceModel.__signature__ = _INFERENCE  # type: ignore[attr-defined]  # (likewise)


def load(filename: str, edit_opts_fn: Callable[[Options], None] | None = None) -> PoplarExecutor:
    """Rebuild the executor saved in ``filename`` (needs ``export_model=True``).

    ``edit_opts_fn(options)`` may change the options first, e.g. to pick a device.
    """
    payload = read_payload(filename)
    if payload["model"] is None:
        raise Error(f"{filename} was saved with export_model=False: create the model with "
                    "poptorch.trainingModel / inferenceModel and call "
                    "loadExecutable(filename) on it instead.")
    options = payload["options"].clone()
    # as upstream: the loaded model runs, whatever offline target it was compiled for
    options.deleteIfExists("ipu_version")
    if options.connection_type == ConnectionType.Never.value:
        options.connectionType(ConnectionType.Always)
    if edit_opts_fn is not None:
        edit_opts_fn(options)
    model = payload["model"]
    if payload["metadata"]["training"]:
        executor = trainingModel(model, options, payload["optimizer"])
    else:
        executor = inferenceModel(model, options)
    executor._restore_from(payload)
    return executor
