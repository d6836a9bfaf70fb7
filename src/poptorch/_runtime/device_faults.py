"""Device and communication faults as PopTorch's errors.

PopTorch raises three kinds of error (the user guide's "Error handling"):
:py:class:`~poptorch.RecoverableError` (likely transient: take its ``recovery_action``,
then go on), :py:class:`~poptorch.UnrecoverableError` (likely to persist: the device
cannot be used again by this process) and :py:class:`~poptorch.Error` (a problem of the
program or of its set-up). On our devices the faults come from CUDA, cuBLAS / cuDNN,
NCCL, gloo and ``torch.distributed``; :py:func:`translate` maps what torch raises for one
onto these types, one :py:class:`Fault` (a row of ``docs/errors.md``) per kind of
fault. The executor raises the translated error, torch's as its ``__cause__``, after it
has undone the failed call; :py:func:`collective_failure` does the same for the
collectives PopTorch runs itself.

torch's exception types say little (a CUDA fault is a ``torch.AcceleratorError`` or a
plain ``RuntimeError``, a NCCL one a ``DistBackendError`` or a ``RuntimeError``), so the
rows are told apart by the stable words of the CUDA / NCCL / gloo error strings.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from ..errors import Error, RecoverableError, UnrecoverableError

__all__ = ["FAULTS", "Fault", "classify", "collective_failure", "translate"]

IPU_RESET = "IPU_RESET"
"""Recovery action: free the device's memory and run again (PopTorch: reset the IPU and
reload its memory)."""
PARTITION_RESET = "PARTITION_RESET"
"""Recovery action: start the run's processes again together (a new process group) and
resume from the last checkpoint (PopTorch: reset the IPU partition of a Pod)."""

_MESSAGE_CHARS = 400  # of torch's message, in ours (the whole one is the __cause__)


@dataclasses.dataclass(frozen=True)
class Fault:
    """One kind of fault: which errors it covers, what PopTorch raises, what to do."""

    name: str
    error: type[Error]
    recovery_action: str | None
    marks: tuple[str, ...]  # words of torch's message (lower case), any of them
    what: str
    todo: str

    def error_for(self, cause: BaseException, context: str = "") -> Error:
        """The PopTorch error for ``cause`` (its message quoted, shortened)."""
        quoted = " ".join(str(cause).split())
        if len(quoted) > _MESSAGE_CHARS:
            quoted = quoted[:_MESSAGE_CHARS] + " ..."
        message = f"{context}{self.what} ({type(cause).__name__}: {quoted}). {self.todo}"
        if self.error is RecoverableError:
            assert self.recovery_action is not None
            return RecoverableError(message, recovery_action=self.recovery_action)
        return self.error(message, type="device_error" if self.error is Error else None)


OUT_OF_MEMORY = Fault(
    "out of memory", RecoverableError, IPU_RESET,
    ("out of memory", "cublas_status_alloc_failed", "cudnn_status_alloc_failed",
     "can't allocate memory", "memory allocation"),
    "The device ran out of memory",
    "Free memory and call again: drop tensors you no longer need, call "
    "torch.cuda.empty_cache(), or use a smaller batch (or more gradient accumulation).")
DEVICE_LOST = Fault(
    "device failed or lost", UnrecoverableError, None,
    ("uncorrectable ecc error", "fallen off the bus", "uncorrectable nvlink error",
     "hardware stack error", "cuda error: unknown error", "gpu is lost"),
    "The GPU failed or was lost",
    "Take it out of service and have it checked (nvidia-smi -q, the Xid messages of the "
    "kernel log); this process cannot use it again.")
CONTEXT_LOST = Fault(
    "device unusable in this process", UnrecoverableError, None,
    ("illegal memory access", "unspecified launch failure", "misaligned address",
     "illegal instruction", "device-side assert triggered", "launch timed out"),
    "A kernel failed and left the GPU unusable by this process",
    "End the process; the next one can use the GPU. This is most often a bug (an index "
    "out of range): run with CUDA_LAUNCH_BLOCKING=1 to see which operation failed.")
DEVICE_SETUP = Fault(
    "device set-up", Error, None,
    ("no kernel image is available", "invalid device ordinal", "driver version is "
     "insufficient", "no cuda-capable device", "busy or unavailable",
     "cudnn_status_not_supported", "cublas_status_not_supported", "not compiled with cuda"),
    "The GPU cannot run this program as it is set up",
    "Check the GPUs the program asks for (CUDA_VISIBLE_DEVICES, the IPU ids), the "
    "driver, and that this build of torch supports the GPU.")
DEVICE_OTHER = Fault(
    "other CUDA error", Error, None, (),
    "The GPU reported an error",
    "See torch's message (the __cause__ of this error).")
COLLECTIVE_MISUSE = Fault(
    "collective used wrongly", Error, None,
    ("invalid usage", "invalid argument", "ncclinvalid"),
    "A collective was called in a way the backend refuses",
    "The processes must call the same collectives, in the same order, on tensors of the "
    "same shapes and dtypes.")
COLLECTIVE_TIMEOUT = Fault(
    "collective timed out", RecoverableError, PARTITION_RESET,
    ("timed out", "timing out", "timeout", "deadline exceeded"),
    "A collective timed out: another process of this run has probably stopped taking part",
    "Start the run's processes again together and resume from the last checkpoint "
    "(POPTORCH_DISTRIBUTED_TIMEOUT sets how long collectives wait).")
PEER_LOST = Fault(
    "collective lost a peer", RecoverableError, PARTITION_RESET,
    ("closed by peer", "reset by peer", "remote process exited", "remote error",
     "broken pipe", "connection refused", "connection closed", "unhandled system error",
     "aborted", "failed to recv", "failed to send"),
    "A collective lost a peer: another process of this run has probably stopped or the "
    "connection between them broke",
    "Start the run's processes again together and resume from the last checkpoint.")
COLLECTIVE_OTHER = Fault(
    "other collective error", RecoverableError, PARTITION_RESET, (),
    "A collective failed: another process of this run has probably stopped or the "
    "connection between them broke",
    "Start the run's processes again together and resume from the last checkpoint.")

FAULTS: tuple[Fault, ...] = (OUT_OF_MEMORY, DEVICE_LOST, CONTEXT_LOST, DEVICE_SETUP,
                             DEVICE_OTHER, COLLECTIVE_MISUSE, PEER_LOST, COLLECTIVE_TIMEOUT,
                             COLLECTIVE_OTHER)
"""Every row, in the order of ``docs/errors.md``."""

# The order each family is tried in: the first row with a mark in the message wins.
_CUDA_ORDER = (OUT_OF_MEMORY, DEVICE_LOST, CONTEXT_LOST, DEVICE_SETUP)
_COLLECTIVE_ORDER = (COLLECTIVE_MISUSE, OUT_OF_MEMORY, DEVICE_LOST, CONTEXT_LOST, PEER_LOST,
                     COLLECTIVE_TIMEOUT)
_CUDA_WORDS = ("cuda error", "cuda driver error", "cudaerror", "cublas_status",
               "cudnn_status", "cuda out of memory", "cuda-capable device", "nvidia driver",
               "driver version is insufficient")
_COLLECTIVE_WORDS = ("nccl", "gloo", "processgroup", "c10d")
_ACCELERATOR_ERROR: type[BaseException] | None = getattr(torch, "AcceleratorError", None)
_DIST_ERROR: type[BaseException] | None = getattr(dist, "DistError", None)


def _first(rows: tuple[Fault, ...], text: str) -> Fault | None:
    for row in rows:
        if any(mark in text for mark in row.marks):
            return row
    return None


def classify(error: BaseException, collective: bool = False) -> Fault | None:
    """The kind of device or communication fault ``error`` is, or None when it is none
    (an error of the model's own code, or already PopTorch's). ``collective``: the
    error comes out of a collective (whatever its words)."""
    if isinstance(error, Error):
        return None
    if isinstance(error, torch.OutOfMemoryError):
        return OUT_OF_MEMORY
    if not isinstance(error, RuntimeError):
        return None
    text = str(error).lower()
    if collective or (_DIST_ERROR is not None and isinstance(error, _DIST_ERROR)) or \
            any(word in text for word in _COLLECTIVE_WORDS):
        return _first(_COLLECTIVE_ORDER, text) or COLLECTIVE_OTHER
    if (_ACCELERATOR_ERROR is not None and isinstance(error, _ACCELERATOR_ERROR)) or \
            any(word in text for word in _CUDA_WORDS):
        return _first(_CUDA_ORDER, text) or DEVICE_OTHER
    if "defaultcpuallocator" in text and "can't allocate memory" in text:
        return OUT_OF_MEMORY  # the host's memory: the CPU is the device here
    return None


def translate(error: BaseException) -> BaseException | None:
    """PopTorch's error for the device or communication fault ``error`` (to be raised
    ``from error``), or None when ``error`` is no such fault and stays as it is."""
    fault = classify(error)
    return None if fault is None else fault.error_for(error)


def collective_failure(what: str, error: RuntimeError) -> Error:
    """PopTorch's error for ``error``, raised by one of PopTorch's own collectives
    (``what``: which one, as a sentence start) across processes."""
    fault = classify(error, collective=True)
    assert fault is not None  # (collective=True always gives a row)
    return fault.error_for(error, context=f"{what} across processes failed. ")
