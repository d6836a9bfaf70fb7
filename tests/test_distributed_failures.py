"""Errors of a distributed run that show without starting processes: which errors count
as a failure of the communication between processes (and become ``poptorch.Error``; the
model's own errors must pass through unchanged, even where DDP also communicates), and
options that disagree with the launcher or the program's own process group."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import poptorch
from poptorch._runtime.distributed.collectives import (failures_as_errors,
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
        with failures_as_errors("Summing gradients (DDP)", runs_model=True):
            raise RuntimeError(GLOO_RESET)
    error = _model_error()
    with pytest.raises(RuntimeError) as info:
        with failures_as_errors("Summing gradients (DDP)", runs_model=True):
            raise error
    assert info.value is error and not isinstance(info.value, poptorch.Error)


def test_around_a_collective_every_runtime_error_is_a_failure():
    with pytest.raises(poptorch.Error, match="Broadcasting tensors across processes"):
        with failures_as_errors("Broadcasting tensors"):
            raise RuntimeError("Timed out waiting 5000ms for recv operation")


class _WithLoss(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(3, 2)

    def forward(self, x):
        out = self.fc(x)
        return out, out.sum()


def test_several_processes_without_an_address_name_the_launcher(monkeypatch):
    assert not dist.is_initialized()
    for var in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    opts = poptorch.Options()
    opts.Distributed.configureProcessId(0, 2)
    training = poptorch.trainingModel(_WithLoss(), opts)
    with pytest.raises(poptorch.Error, match="MASTER_ADDR and MASTER_PORT are not set.*torchrun"):
        training(torch.ones(1, 3))
    assert not dist.is_initialized()


def test_options_that_disagree_with_the_programs_own_group_are_an_error(tmp_path):
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1),
                            rank=0, world_size=1)
    try:
        opts = poptorch.Options()
        opts.Distributed.configureProcessId(0, 2)
        training = poptorch.trainingModel(_WithLoss(), opts)
        with pytest.raises(poptorch.Error, match="Options.Distributed says process 0 of 2, "
                           "but the torch.distributed process group says rank 0 of 1"):
            training(torch.ones(1, 3))
    finally:
        dist.destroy_process_group()
