"""Saving compiled models to a file and loading them back.

A file holds one ``torch.save`` payload: metadata, the options, the model's state dict,
the optimizer (hyperparameters and state) and, with ``export_model=True``, the torch
model itself, pickled together so that the optimizer keeps referring to the model's
parameters. Our "executable" is rebuilt from these on load; nothing device-specific is
stored, so a file saved on a GPU loads on the CPU and vice versa.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from ..errors import Error

FORMAT = "openpoptorch-executable"


def save_executor(executor: Any, filename: str, export_model: bool,
                  save_rng_state: bool) -> None:
    """Write ``executor`` to ``filename`` (see module docstring)."""
    executor.copyWeightsToHostIfNeeded()
    training = executor._training
    optimizer = executor._optimizer if training else None
    payload = {
        "format": FORMAT,
        "metadata": {"poptorch_version": executor._poptorch_version,
                     "training": training,
                     "options": executor._options.toDict(),
                     "model_class": type(executor._user_model).__qualname__},
        "options": executor._options,
        "state_dict": executor._user_model.state_dict(),
        "model": executor._user_model if export_model else None,
        "optimizer": optimizer if export_model else None,
        "optimizer_state": None if optimizer is None else optimizer.state_dict(),
        "rng_state": executor.rng_state if save_rng_state else None,
    }
    torch.save(payload, filename)


def _read(filename: str) -> dict:
    try:
        payload = torch.load(filename, weights_only=False, map_location="cpu")
    except FileNotFoundError:
        raise
    except Exception as e:  # corrupt or foreign file
        raise Error(f"{filename} is not a model saved by poptorch "
                    f"(compileAndExport / save): {e}") from e
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise Error(f"{filename} is not a model saved by poptorch (compileAndExport / save).")
    return payload


def importPoptorchMetadataFromFile(import_filename: str) -> dict:
    """The metadata of a saved model: version, training flag, options, model class."""
    return _read(import_filename)["metadata"]


def load(filename: str, edit_opts_fn: Callable[[Any], None] | None = None) -> Any:
    """Rebuild the executor saved in ``filename`` (needs ``export_model=True``).

    ``edit_opts_fn(options)`` may change the options first, e.g. to pick a device.
    """
    from .. import _factory as executor_factory
    payload = _read(filename)
    if payload["model"] is None:
        raise Error(f"{filename} was saved with export_model=False: create the model with "
                    "poptorch.trainingModel / inferenceModel and call "
                    "loadExecutable(filename) on it instead.")
    options = payload["options"].clone()
    if edit_opts_fn is not None:
        edit_opts_fn(options)
    model = payload["model"]
    if payload["metadata"]["training"]:
        executor = executor_factory.trainingModel(model, options, payload["optimizer"])
    else:
        executor = executor_factory.inferenceModel(model, options)
    executor.__dict__["_pending_rng_state"] = payload["rng_state"]
    return executor


def load_into(executor: Any, filename: str) -> None:
    """Restore weights, optimizer state and random state saved in ``filename``."""
    payload = _read(filename)
    if payload["metadata"]["training"] != executor._training:
        kind = "training" if payload["metadata"]["training"] else "inference"
        raise Error(f"{filename} holds a {kind} model; load it into a "
                    f"{kind}Model, not this one.")
    executor.load_state_dict(payload["state_dict"])
    if executor._training and payload["optimizer_state"] is not None:
        executor._optimizer.load_state_dict(payload["optimizer_state"])
    executor.__dict__["_pending_rng_state"] = payload["rng_state"]
    if executor.isCompiled():
        _apply_pending_rng(executor)


def _apply_pending_rng(executor: Any) -> None:
    state = executor.__dict__.pop("_pending_rng_state", None)
    if state is not None and state[0] is not None:
        executor.rng_state = state
