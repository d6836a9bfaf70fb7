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
from collections.abc import Callable
from typing import IO

import torch

from .._logging import logger
from .._typing import OptionsView
from ..errors import Error
from .compilation import Compilation
from .program.undo import RandomState, StateUndo

FORMAT = "openpoptorch-executable"


def compile_by_running(compiled: Compilation, model: torch.nn.Module,
                       run: Callable[[], object]) -> None:
    """Make a compiling backend compile (``torch.compile`` compiles on first use) by
    calling ``run()`` (one call of the model on the example inputs) until the program's
    first calls are over, then undo everything the calls changed in ``model`` (the
    device model) and the program: weights, buffers, optimizer and loss-scaler state,
    random state. Used by ``compileAndExport`` so that the file holds the compiled
    program."""
    source = compiled.source
    if not source.compiles or not source.fresh:
        return
    binding = compiled.optimizer
    program = compiled.program
    undo = StateUndo(list(model.parameters()) + list(model.buffers()),
                     optimizer=None if binding is None else binding.device,
                     scaler=None if binding is None else binding.scaler,
                     rng=RandomState())
    rng = program.rng
    rng_state = None if rng.state is None else rng.state.clone()
    try:
        while source.fresh:  # the compiled pieces compile at the second call
            run()
    finally:
        undo.restore()
        rng.state = rng_state
        compiled.weights_to_device()


DEFAULT_FILE_NAME = "model.poptorch"


def save_target(filename: str | os.PathLike[str] | IO[bytes]) -> str | IO[bytes]:
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


def save_compiled(filename: str | os.PathLike[str] | IO[bytes], compiled: Compilation, *,
                  user_model: torch.nn.Module, options: OptionsView, training: bool,
                  optimizer: torch.optim.Optimizer | None, version: str,
                  rng_state: list | None, export_model: bool) -> None:
    """Write a compiled model to ``filename`` (see module docstring and
    :func:`save_target`): ``compiled`` and what the user sees of the model (the
    host model with its current weights, its options, training flag, optimizer,
    poptorch version and random state)."""
    from .executable import artifacts
    filename = save_target(filename)
    source = compiled.source
    collected = None
    if source.compiles and source.warmup_calls < 2:
        collected = artifacts.collect()
    optimizer = optimizer if training else None
    payload = {
        "format": FORMAT,
        "metadata": {"poptorch_version": version,
                     "training": training,
                     "options": options.toDict(),
                     "model_class": type(user_model).__qualname__},
        "options": options,
        "state_dict": user_model.state_dict(),
        "model": user_model if export_model else None,
        "optimizer": optimizer if export_model else None,
        "optimizer_state": None if optimizer is None else optimizer.state_dict(),
        "rng_state": rng_state,
        "signature": source.signature,
        "compiled": collected,
        # the backend the model's trial chose ("compiled" / "eager", None: undecided):
        # the loaded model takes it without measuring again
        "backend_decision": compiled.program.selector.decision,
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


def precompiled_of(payload: dict) -> dict:
    """What a file hands to the next compile of the model it is loaded into: the input
    signature, the compiled program and the backend decision."""
    return {"signature": payload.get("signature"), "artifacts": payload.get("compiled"),
            "backend_decision": payload.get("backend_decision")}


def check_kind(payload: dict, training: bool, filename: str) -> None:
    """A training model loads only into a trainingModel, an inference model only into
    an inferenceModel (``poptorch.Error`` otherwise)."""
    if payload["metadata"]["training"] != training:
        kind = "training" if payload["metadata"]["training"] else "inference"
        raise Error(f"{filename} holds a {kind} model; load it into a "
                    f"{kind}Model, not this one.")
