"""``trainingModel`` and ``inferenceModel``, including the legacy positional form.

SDK 1.x programs call ``trainingModel(model, device_iterations, gradient_accumulation=1,
replication_factor=1, profile=False, trace_model=True, loss=None, optimizer=None)``; those
arguments are turned into :py:class:`poptorch.Options` here.
"""
from __future__ import annotations

import gc
import inspect
import weakref
from collections.abc import Callable

import torch

from .._runtime.attributes import own_attribute
from .._runtime.export import read_payload
from .._typing import UserInput, UserOutput
from .._version import __version__
from ..enums import ConnectionType
from ..errors import Error, PoptorchRuntimeError
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


# The training wrapper of each module wrapped by ``trainingModel`` (upstream allows one
# at a time), by id(module): (the module, the wrapper), both weakly held (by identity:
# a module class may define __eq__ / __hash__). Until the wrapper is destroyed, or no
# longer reachable, the module cannot be wrapped for training again. Inference wrappers
# are not counted.
_WrapperEntry = tuple["weakref.ref[torch.nn.Module]", "weakref.ref[PoplarExecutor]"]
_TRAINING_WRAPPERS: dict[int, _WrapperEntry] = {}


class _DestroyHandle:
    """``model.destroy()`` on a module wrapped by ``trainingModel``: destroys its wrapper
    (releases the device and the compiled program), after which the module may be wrapped
    for training again. Copies and pickles of the module get a handle bound to nothing,
    which does nothing (as upstream's, once its wrapper is gone)."""
    __slots__ = ("_executor",)

    def __init__(self, executor: PoplarExecutor | None = None) -> None:
        self._executor = None if executor is None else weakref.ref(executor)

    def __call__(self) -> None:
        executor = None if self._executor is None else self._executor()
        if executor is not None:
            executor.destroy()

    def __reduce__(self) -> tuple[type[_DestroyHandle], tuple]:
        return _DestroyHandle, ()

    def __deepcopy__(self, memo: dict) -> _DestroyHandle:
        return _DestroyHandle()


def _live_training_wrapper(module: torch.nn.Module) -> PoplarExecutor | None:
    entry = _TRAINING_WRAPPERS.get(id(module))
    return None if entry is None or entry[0]() is not module else entry[1]()


def _refuse_second_training_wrapper(module: torch.nn.Module) -> None:
    """Upstream's rule: a module already wrapped by a live ``trainingModel`` is refused
    (an unreachable wrapper, collected here first, does not count)."""
    if _live_training_wrapper(module) is None:
        return
    gc.collect()  # (a wrapper the program no longer reaches may sit in a cycle)
    if _live_training_wrapper(module) is None:
        return
    raise PoptorchRuntimeError(
        "Model has already been wrapped in 'poptorch.trainingModel'. Call model.destroy() "
        "on the model to unwrap before wrapping again. (destroy() on the training "
        "wrapper does the same; an inferenceModel of the module needs no unwrapping.)")


def _mark_wrapped(module: torch.nn.Module, executor: PoplarExecutor) -> None:
    """Record ``executor`` as ``module``'s training wrapper and give the module
    ``destroy()`` (unless its class or the instance has a ``destroy`` of its own);
    ``executor.destroy()`` undoes both."""
    for key, (module_ref, executor_ref) in list(_TRAINING_WRAPPERS.items()):
        if module_ref() is None or executor_ref() is None:  # (either is gone)
            del _TRAINING_WRAPPERS[key]
    entry = _TRAINING_WRAPPERS[id(module)] = (weakref.ref(module), weakref.ref(executor))
    handle: _DestroyHandle | None = None
    if isinstance(own_attribute(module, "destroy"), _DestroyHandle) \
            or not hasattr(module, "destroy"):
        handle = _DestroyHandle(executor)
        try:
            object.__setattr__(module, "destroy", handle)  # (a plain instance attribute)
        except (AttributeError, TypeError):  # a module class that refuses new attributes
            handle = None

    def release() -> None:  # (weak references only: no cycle through the executor)
        owner = entry[0]()
        if owner is None:
            return
        if _TRAINING_WRAPPERS.get(id(owner)) is entry:
            del _TRAINING_WRAPPERS[id(owner)]
        if handle is not None and own_attribute(owner, "destroy") is handle:
            object.__delattr__(owner, "destroy")
    executor._release_module_on_destroy(release)


def trainingModel(*args: object, **kwargs: object) -> PoplarExecutor:
    """trainingModel(model, options=None, optimizer=None)

    Wrap ``model`` for training: each call runs forward, backward and the optimizer
    update for a whole batch of micro-batches (see the batching guide). ``optimizer``
    defaults to ``poptorch.optim.SGD(lr=0.01)``. The wrapper shares the model's
    parameters: trained values show in ``model`` without explicit copies.

    As upstream, one module has one training wrapper at a time: wrapping it again
    raises (a ``RuntimeError``, also a ``poptorch.Error``) until ``model.destroy()`` (or
    ``destroy()`` on the wrapper) releases it. Inference wrappers are not limited.

    The SDK 1.x form ``trainingModel(model, device_iterations, gradient_accumulation=1,
    replication_factor=1, profile=False, trace_model=True, loss=None, optimizer=None)``
    is accepted too; ``loss`` is a module applied as ``loss(model(*inputs), label)``.
    """
    values = _bind(_TRAINING, _LEGACY_TRAINING, args, kwargs, "trainingModel")
    options = _legacy_options(values) if values["legacy"] else values["options"]
    optimizer, loss = values["optimizer"], values.get("loss")
    model = user_model = wrapped = _unwrap(values["model"])
    _refuse_second_training_wrapper(wrapped)
    if loss is not None:
        if optimizer is None:
            optimizer = SGD(model.parameters(), lr=0.01)
        model = user_model = _ModelWithLoss(model, loss)
    executor = PoplarExecutor(model, options, True, _VERSION, optimizer, user_model)
    _mark_wrapped(wrapped, executor)
    return executor


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
