"""Saving compiled models to a file and loading them back.

A file holds one ``torch.save`` payload: metadata, the options, the model's state dict,
the optimizer (hyperparameters and state) and, with ``export_model=True``, the torch
model itself, pickled together so that the optimizer keeps referring to the model's
parameters. Our "executable" is rebuilt from these on load; nothing device-specific is
stored, so a file saved on a GPU loads on the CPU and vice versa.
"""
from __future__ import annotations

from typing import Any

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


def read_payload(filename: str) -> dict:
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
    return read_payload(import_filename)["metadata"]


def load_into(executor: Any, filename: str) -> None:
    """Restore weights, optimizer state and random state saved in ``filename``."""
    payload = read_payload(filename)
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
