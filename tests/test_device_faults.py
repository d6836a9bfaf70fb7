"""Device and communication faults are PopTorch's errors (``_runtime/device_faults.py``,
docs/errors.md): each row of the table, injected on the CPU as the exception torch
raises for it, reaches the caller as the row's PopTorch error (type, ``recovery_action``,
torch's error as its ``__cause__``), after the failed call has been undone: the weights,
buffers and optimizer state are those from before the call, and training goes on as
plain PyTorch does without the failed batch. A gloo peer that dies or stalls in a real
2-process run is tested the same way."""
from __future__ import annotations

import copy
import os
import pathlib
import socket
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

import poptorch
from poptorch._runtime import device_faults
from poptorch._runtime.device_faults import FAULTS, classify, translate

HERE = pathlib.Path(__file__).resolve().parent
DOCS = HERE.parent / "docs" / "errors.md"

# One exception per row, worded as torch / CUDA / NCCL word them.
INJECTED = {
    "out of memory": lambda: torch.OutOfMemoryError(
        "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
        "79.19 GiB of which 1.06 GiB is free."),
    "device failed or lost": lambda: torch.AcceleratorError(
        "CUDA error: uncorrectable ECC error encountered\nCUDA kernel errors might be "
        "asynchronously reported at some other API call."),
    "device unusable in this process": lambda: torch.AcceleratorError(
        "CUDA error: an illegal memory access was encountered\nCompile with "
        "`TORCH_USE_CUDA_DSA` to enable device-side assertions."),
    "device set-up": lambda: torch.AcceleratorError(
        "CUDA error: no kernel image is available for execution on the device"),
    "other CUDA error": lambda: RuntimeError(
        "CUDA error: operation not permitted when stream is capturing"),
    "collective used wrongly": lambda: dist.DistBackendError(
        "NCCL error in: ProcessGroupNCCL.cpp:3356, invalid usage (run with NCCL_DEBUG=WARN "
        "for details), NCCL version 2.27.3\nncclInvalidUsage: This usually reflects invalid "
        "usage of NCCL library."),
    "collective lost a peer": lambda: dist.DistBackendError(
        "NCCL error in: ProcessGroupNCCL.cpp:3356, remote process exited or there was a "
        "network error, NCCL version 2.27.3\nncclRemoteError: A call failed possibly due to "
        "a network error or a remote process exiting prematurely."),
    "collective timed out": lambda: dist.DistBackendError(
        "[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=41, "
        "OpType=ALLREDUCE, NumelIn=1024, NumelOut=1024, Timeout(ms)=600000) ran for 600042 "
        "milliseconds before timing out."),
    "other collective error": lambda: dist.DistBackendError(
        "NCCL error in: ProcessGroupNCCL.cpp:3356, internal error - please report this "
        "issue to the NCCL developers, NCCL version 2.27.3"),
}
ROWS = {fault.name: fault for fault in FAULTS}


def test_every_row_is_injected_and_documented():
    assert set(INJECTED) == set(ROWS)
    text = DOCS.read_text()
    for fault in FAULTS:
        assert f"| {fault.name} |" in text, f"docs/errors.md lacks the row {fault.name!r}"


# -- which row: torch's own wordings ----------------------------------------------------
def _model_error() -> RuntimeError:
    try:
        torch.nn.Linear(3, 2)(torch.ones(2, 4))
    except RuntimeError as exc:
        return exc
    raise AssertionError("the model did not fail")


@pytest.mark.parametrize("error,row", [
    (RuntimeError("CUDA error: out of memory"), "out of memory"),
    (RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"),
     "out of memory"),
    (RuntimeError("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't "
                  "allocate memory: you tried to allocate 1099511627776 bytes."),
     "out of memory"),
    (RuntimeError("CUDA error: unknown error"), "device failed or lost"),
    (RuntimeError("CUDA error: device-side assert triggered"),
     "device unusable in this process"),
    (RuntimeError("CUDA error: unspecified launch failure"), "device unusable in this process"),
    (RuntimeError("CUDA error: invalid device ordinal"), "device set-up"),
    (RuntimeError("Found no NVIDIA driver on your system. CUDA driver version is "
                  "insufficient for CUDA runtime version"), "device set-up"),
    (RuntimeError("NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled cuda error (run with "
                  "NCCL_DEBUG=INFO for details), NCCL version 2.27.3\nncclUnhandledCudaError: "
                  "Call to CUDA function failed.\nLast error:\nCuda failure 'out of memory'"),
     "out of memory"),
    (RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
                  "[127.0.0.1]:20616: Connection reset by peer"), "collective lost a peer"),
    (RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:598] Connection closed by "
                  "peer [127.0.0.1]:46245"), "collective lost a peer"),
    (dist.DistNetworkError("Connection reset by peer"), "collective lost a peer"),
    (dist.DistBackendError("NCCL communicator was aborted on rank 1."),
     "collective lost a peer"),
    (RuntimeError("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out "
                  "waiting 5000ms for recv operation to complete"), "collective timed out"),
    (dist.DistStoreError("wait timeout after 30000ms, keys: /default_pg/0//cuda//0"),
     "collective timed out"),
])
def test_torch_wordings_are_classified(error, row):
    assert classify(error) is ROWS[row]


def test_errors_that_are_no_device_fault_stay_as_they_are():
    for error in (_model_error(), ValueError("CUDA error: out of memory"),
                  KeyboardInterrupt(), poptorch.Error("CUDA error: out of memory"),
                  RuntimeError("a tensor of the model is too large")):
        assert classify(error) is None and translate(error) is None


@pytest.mark.parametrize("row", sorted(ROWS))
def test_translated_error_has_the_rows_type_action_and_words(row):
    fault = ROWS[row]
    cause = INJECTED[row]()
    error = translate(cause)
    assert type(error) is fault.error and isinstance(error, poptorch.Error)
    assert getattr(error, "recovery_action", None) == fault.recovery_action
    assert fault.what in error.message and fault.todo in error.message
    assert str(cause).split("\n")[0][:60] in error.message  # torch's words are quoted
    assert error.location  # where the user's program called (this test)


def test_the_guides_recovery_actions():
    """The user guide's actions: IPU_RESET, LINK_RESET, PARTITION_RESET, FULL_RESET."""
    for fault in FAULTS:
        assert (fault.recovery_action is not None) == (fault.error is poptorch.RecoverableError)
        assert fault.recovery_action in (None, "IPU_RESET", "LINK_RESET", "PARTITION_RESET",
                                         "FULL_RESET")


# -- in a model: the error type, and the model as before the call -----------------------
ARMED: dict = {"at": None, "error": None}


def _fire(place: str) -> None:
    if ARMED["at"] == place:
        ARMED["at"] = None
        raise ARMED["error"]


class _FailsInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        _fire("backward")
        return grad


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 6)
        self.bn = torch.nn.BatchNorm1d(6)  # buffers: updated by the forward
        self.out = torch.nn.Linear(6, 3)

    def forward(self, x, y):
        hidden = _FailsInBackward.apply(self.bn(self.fc(x)))
        _fire("forward")
        out = self.out(torch.relu(hidden))
        return out, F.mse_loss(out, y)


@pytest.fixture
def optimizer_hooks():
    """Faults raised by an optimizer step, before or after it updates the parameters
    (as a collective of a sharded step would); removed after the test."""
    handles = [register_optimizer_step_pre_hook(lambda *_: _fire("step")),
               register_optimizer_step_post_hook(lambda *_: _fire("after step"))]
    yield
    for handle in handles:
        handle.remove()
    ARMED.update(at=None, error=None)


def _state(model: Net, optimizer: torch.optim.Optimizer) -> tuple:
    return copy.deepcopy((model.state_dict(), optimizer.state_dict()["state"]))


def _assert_same(actual: tuple, expected: tuple) -> None:
    (weights, opt_state), (ref_weights, ref_state) = actual, expected
    assert weights.keys() == ref_weights.keys()
    for name in weights:
        assert torch.equal(weights[name], ref_weights[name]), name
    assert opt_state.keys() == ref_state.keys()
    for key in opt_state:
        for name, value in opt_state[key].items():
            assert torch.equal(value, ref_state[key][name]), (key, name)


# where the fault happens: (place, the call that fails, device iterations)
PLACES = {
    "first call, forward": ("forward", 0, 1),
    "later call, forward": ("forward", 3, 1),  # the per-call fast path
    "later call, backward": ("backward", 3, 1),
    "later call, optimizer step": ("step", 3, 1),
    "second step of a call, forward": ("forward", 3, 2),  # after one update in the call
}


# every row at one place, and every place with one row
CASES = [(row, "later call, forward") for row in sorted(ROWS)] + [
    ("collective lost a peer", place) for place in PLACES if place != "later call, forward"]


@pytest.mark.parametrize("row,place", CASES)
def test_fault_is_poptorchs_error_and_the_call_is_undone(row, place, optimizer_hooks):
    at, failing_call, d = PLACES[place]
    fault = ROWS[row]
    torch.manual_seed(0)
    model = Net()
    reference = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    opts = poptorch.Options().deviceIterations(d)
    opts.showCompilationProgressBar(False)
    training = poptorch.trainingModel(model, opts, optimizer)
    second_step_fails = d == 2
    for call in range(6):
        x, y = torch.randn(4 * d, 4), torch.randn(4 * d, 3)
        if call == failing_call:
            before = _state(model, optimizer)
            injected = INJECTED[row]()
            ARMED.update(at=None if second_step_fails else at, error=injected)
            if second_step_fails:  # the fault comes in the call's second forward
                calls = {"n": 0}

                def second_forward(*_, calls=calls):
                    calls["n"] += 1
                    if calls["n"] == 2:
                        ARMED["at"] = "forward"
                handle = model.fc.register_forward_pre_hook(second_forward)
            with pytest.raises(poptorch.Error) as info:
                training(x, y)
            if second_step_fails:
                handle.remove()
            assert type(info.value) is fault.error, info.value
            assert getattr(info.value, "recovery_action", None) == fault.recovery_action
            assert info.value.__cause__ is injected
            if call > 0:
                training.copyWeightsToHost()
            _assert_same(_state(model, optimizer), before)
            continue
        _, loss = training(x, y)
        for step in range(d):  # plain PyTorch, without the failed call's batch
            rows = slice(4 * step, 4 * (step + 1))
            ref_optimizer.zero_grad()
            _, ref_loss = reference(x[rows], y[rows])
            ref_loss.backward()
            ref_optimizer.step()
        torch.testing.assert_close(loss, ref_loss.detach().expand_as(loss))
    training.copyWeightsToHost()
    _assert_same(_state(model, optimizer), _state(reference, ref_optimizer))


def test_a_fault_after_the_update_of_a_one_step_call_is_undone(optimizer_hooks):
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    opts = poptorch.Options()
    opts.showCompilationProgressBar(False)
    training = poptorch.trainingModel(model, opts, optimizer)
    for _ in range(3):
        training(torch.randn(4, 4), torch.randn(4, 3))
    training.copyWeightsToHost()
    before = _state(model, optimizer)
    ARMED.update(at="after step", error=INJECTED["collective lost a peer"]())
    with pytest.raises(poptorch.RecoverableError):
        training(torch.randn(4, 4), torch.randn(4, 3))
    training.copyWeightsToHost()
    _assert_same(_state(model, optimizer), before)


# -- a real gloo peer, lost -------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(150)
@pytest.mark.parametrize("how,row", [("kill", "collective lost a peer"),
                                     ("stall", "collective timed out")])
def test_a_lost_gloo_peer_is_a_recoverable_error_and_the_call_is_undone(tmp_path, how, row):
    """Process 1 of 2 dies (SIGKILL) or stops taking part after its third call; process
    0's fourth call raises the row's RecoverableError (PARTITION_RESET) with its weights
    and optimizer state as before that call (tests/device_fault_worker.py)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(_free_port()), POPTORCH_DISTRIBUTED_TIMEOUT="5",
               POPTORCH_BACKEND="eager",
               PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    for var in ("LOCAL_RANK", "TORCHELASTIC_RUN_ID"):
        env.pop(var, None)
    procs = [subprocess.Popen([sys.executable, str(HERE / "device_fault_worker.py"),
                               str(tmp_path), how], cwd=HERE, env=dict(env, RANK=str(rank)),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for rank in (0, 1)]
    try:
        outputs = [proc.communicate(timeout=120)[0] for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    assert procs[0].returncode == 3, outputs[0][-3000:]
    seen = torch.load(tmp_path / "fault.pt", weights_only=False)
    fault = ROWS[row]
    assert seen["type"] == "poptorch.errors.RecoverableError", seen
    assert seen["recovery_action"] == "PARTITION_RESET" == fault.recovery_action
    assert fault.what in seen["message"], seen["message"]
    assert seen["calls"] == 3 and seen["unchanged"], seen
    assert seen["seconds"] < 60


def test_collective_failure_names_the_collective():
    error = device_faults.collective_failure("Summing gradients", RuntimeError(
        "Timed out waiting 5000ms for recv operation to complete"))
    assert type(error) is poptorch.RecoverableError
    assert error.message.startswith("Summing gradients across processes failed. A "
                                    "collective timed out")
