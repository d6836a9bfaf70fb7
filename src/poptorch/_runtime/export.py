"""Saving compiled models to a file and loading them back (precompilation).

A file holds one ``torch.save`` payload: metadata, the options, the model's state dict,
the optimizer (hyperparameters and state), the random state, the *input signature* the
program was compiled for and, on a compiling backend, the *compiled program*
(``_runtime/executable/artifacts.py``: torch's compiler-cache entries and the kernel binaries).
With ``export_model=True`` the torch model itself is pickled too, together with the
optimizer so that it keeps referring to the model's parameters.

``poptorch.load`` (or ``loadExecutable``) installs the compiled program before the first
call, so a fresh process runs it without compiling kernels, and every call's inputs
must match the signature (``poptorch.Error`` otherwise). Compiled artefacts are specific
to the torch version and the machine's kind; where they do not fit, the model compiles
again with a warning and gives the same results. The weights and states are
device-independent: a file saved on a GPU loads on the CPU and vice versa.
"""
from __future__ import annotations

import os
from typing import Any

import torch

from .._logging import logger
from ..errors import Error

FORMAT = "openpoptorch-executable"


def compile_by_running(executor: Any, args: tuple, kwargs: dict) -> None:
    """Make a compiling backend compile (``torch.compile`` compiles on first use) by
    running one call on the example inputs, then undo everything the call changed:
    weights, buffers, optimizer and loss-scaler state, random state. Used by
    ``compileAndExport`` so that the file holds the compiled program."""
    import copy
    if not executor.isCompiled():
        executor.compile(*args, **kwargs)
    source = executor._source
    if source is None or not source.compiles or not source.fresh:
        return
    model = executor._model
    tensors = [(t, t.detach().clone()) for t in
               list(model.parameters()) + list(model.buffers())]
    optimizer = executor._device_optimizer
    if optimizer is not None:  # restored in place: the user's references stay valid
        opt_state = {p: copy.deepcopy(st) for p, st in optimizer.state.items()}
        opt_groups = [{k: copy.deepcopy(v) for k, v in g.items() if k != "params"}
                      for g in optimizer.param_groups]
    program = executor._program
    scaler = program.scaler
    scaler_state = None if scaler is None else scaler.state_dict()
    rng = program.rng
    rng_state = None if rng.state is None else rng.state.clone()
    host_rng = torch.get_rng_state()
    try:
        while source.fresh:  # the compiled step compiles at the first or second call
            executor(*args, **kwargs)
    finally:
        with torch.no_grad():
            for t, saved in tensors:
                t.copy_(saved)
        if optimizer is not None:
            optimizer.state.clear()
            optimizer.state.update(opt_state)
            for group, saved in zip(optimizer.param_groups, opt_groups, strict=False):
                group.update(saved)
        if scaler is not None:
            scaler.load_state_dict(scaler_state)
        rng.state = rng_state
        torch.set_rng_state(host_rng)
        executor._weights_to_device()


DEFAULT_FILE_NAME = "model.poptorch"


def save_target(filename: Any) -> Any:
    """Where ``save`` / ``compileAndExport`` write, as PopTorch: a path naming an existing
    directory means ``<directory>/model.poptorch`` (with a warning), and a missing parent
    directory is created. File objects are used as they are."""
    if not isinstance(filename, (str, os.PathLike)):
        return filename
    filename = os.fspath(filename)
    if os.path.isdir(filename):
        target = os.path.join(filename, DEFAULT_FILE_NAME)
        logger.warning("save(): %s is a directory, saving model to %s", filename, target)
        return target
    parent = os.path.dirname(filename)
    if parent and not os.path.isdir(parent):
        os.makedirs(parent, exist_ok=True)
    return filename


def save_executor(executor: Any, filename: str, export_model: bool,
                  save_rng_state: bool) -> None:
    """Write ``executor`` to ``filename`` (see module docstring and :func:`save_target`)."""
    from .executable import artifacts
    filename = save_target(filename)
    executor.copyWeightsToHostIfNeeded()
    source = executor._source
    compiled = None
    if source is not None and source.compiles and source.warmup_calls < 2:
        compiled = artifacts.collect()
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
        "signature": None if source is None else source.signature,
        "compiled": compiled,
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


def stash_precompiled(executor: Any, payload: dict) -> None:
    """Hand the signature and compiled program to the executor's next compile."""
    executor._pending_precompiled = {
        "signature": payload.get("signature"), "artifacts": payload.get("compiled")}
    source = executor._source
    if source is not None and executor.isCompiled():
        # Already compiled here: nothing to install, but the signature still holds.
        source.expected = payload.get("signature")


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
    executor._pending_rng_state = payload["rng_state"]
    stash_precompiled(executor, payload)
    if executor.isCompiled():
        _apply_pending_rng(executor)


def _apply_pending_rng(executor: Any) -> None:
    state, executor._pending_rng_state = executor._pending_rng_state, None
    if state is not None and state[0] is not None:
        executor.rng_state = state
