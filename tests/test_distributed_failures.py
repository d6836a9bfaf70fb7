"""Which errors count as a failure of the communication between processes (and become
``poptorch.Error``), without starting processes: the model's own errors must pass through
unchanged, even when they surface where DDP also communicates."""
from __future__ import annotations

import pytest
import torch

import poptorch
from poptorch._runtime.distributed.collectives import (communication_failures_as_errors,
                                                       failures_as_errors,
                                                       is_communication_failure)

GLOO_RESET = ("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
              "[127.0.0.1]:20616: Connection reset by peer.")


def _model_error() -> RuntimeError:
    try:
        torch.nn.Linear(3, 2)(torch.ones(2, 4))
    except RuntimeError as exc:
        return exc
    raise AssertionError("the model did not fail")


def test_backend_errors_are_communication_failures():
    assert is_communication_failure(RuntimeError(GLOO_RESET))
    assert is_communication_failure(RuntimeError("NCCL error: unhandled system error"))
    assert not is_communication_failure(_model_error())
    assert not is_communication_failure(ValueError("gloo"))


def test_only_backend_errors_become_poptorch_errors_around_model_code():
    with pytest.raises(poptorch.Error, match="another process of this run"):
        with communication_failures_as_errors("Summing gradients (DDP)"):
            raise RuntimeError(GLOO_RESET)
    error = _model_error()
    with pytest.raises(RuntimeError) as info:
        with communication_failures_as_errors("Summing gradients (DDP)"):
            raise error
    assert info.value is error and not isinstance(info.value, poptorch.Error)


def test_around_a_collective_every_runtime_error_is_a_failure():
    with pytest.raises(poptorch.Error, match="Broadcasting tensors across processes"):
        with failures_as_errors("Broadcasting tensors"):
            raise RuntimeError("Timed out waiting 5000ms for recv operation")
