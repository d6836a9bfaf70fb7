"""``poptorch._impl``: the few helpers of upstream's private module that libraries built
on PopTorch import (optimum-graphcore: ``rewrapModelIfNecessary`` /
``unwrapModelIfNecessary``).

Upstream *wraps* a trained model: its class and its parameters' classes are replaced so
that reading them copies the weights from the IPU first. Ours does the same only when the
weights live on an accelerator (``_runtime/weights.py``); on the CPU the user's module and
the device share every tensor and nothing is wrapped, so these helpers have nothing to do.
"""
from __future__ import annotations

import torch

from ._runtime import context
from ._runtime.weights.sync import is_hooked, rehook, unhook
from .errors import createPoptorchError

__all__ = ["createPoptorchError", "isDispatchTracing", "isRunningOnIpu", "isWrapped",
           "rewrapModelIfNecessary", "unwrapModelIfNecessary"]


def isRunningOnIpu() -> bool:
    """True while a model runs inside a PopTorch executor (``poptorch.isRunningOnIpu``)."""
    return context.is_running_on_ipu()


def isDispatchTracing() -> bool:
    """Always False: the model is never traced through an IPU dispatcher here.

    Upstream PopTorch captures ``forward`` with a dispatcher that only accepts tensors
    created with ``device="ipu"``, and code asks this to choose the device of tensors it
    creates. Here ``forward`` runs as ordinary PyTorch on the model's device, so tensors
    created without a device (or on the device of the inputs) are the right ones.
    """
    return False


def isWrapped(model: torch.nn.Module) -> bool:
    """True if reads of ``model`` copy the weights back from the device first."""
    return is_hooked(model)


def unwrapModelIfNecessary(model: torch.nn.Module) -> None:
    """Copy newer device weights into ``model`` and remove the implicit-copy wrapping, so
    that the model can be modified as a plain module (no-op when it is not wrapped)."""
    unhook(model)


def rewrapModelIfNecessary(model: torch.nn.Module) -> None:
    """Restore the wrapping removed by :func:`unwrapModelIfNecessary` (no-op otherwise)."""
    rehook(model)
