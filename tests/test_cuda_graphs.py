"""Calls replayed as CUDA graphs (``_runtime/program/cuda_graphs.py``).

The decision (capturable or not, and why) and the graph's key (what makes it recorded
again) are read from a program's configuration, so they are tested here on the CPU with
real programs; the capture and replay themselves run only on a GPU (the last tests,
skipped without CUDA, run by ``benchmarks/gpu_check.sh``).
"""
import copy
import dataclasses
import logging

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import poptorch
from poptorch._runtime.program import cuda_graphs
from poptorch._runtime.program.cuda_graphs import GraphKey, capture_blocker

CUDA = torch.device("cuda", 0)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(6, 8)
        self.fc2 = nn.Linear(8, 3)

    def forward(self, x, y):
        out = self.fc2(F.relu(self.fc1(x)))
        return out, F.cross_entropy(out, y)


def _data(n=4, device="cpu"):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(n, 6, generator=g).to(device),
            torch.randint(0, 3, (n,), generator=g).to(device))


def _program(training=True, optimizer=None, opts=None, model=None):
    """A real program compiled on the CPU (eager backend), and its model."""
    opts = opts or poptorch.Options()
    opts.showCompilationProgressBar(False)
    opts.Jit.backend("eager")
    model = model or Net()
    if training:
        optimizer = optimizer or torch.optim.SGD(model.parameters(), lr=0.1)
        pop = poptorch.trainingModel(model, opts, optimizer)
    else:
        pop = poptorch.inferenceModel(model, opts)
    pop.compile(*_data())  # the program, without running it (capturable Adam needs a GPU)
    return pop


def _blocker(program, **changes):
    """``capture_blocker`` of ``program`` as if it ran on a GPU (with ``changes`` to its
    spec)."""
    spec = dataclasses.replace(program.spec, **{"device": CUDA, **changes})
    return capture_blocker(spec, program.binding)


def test_a_plain_program_on_a_gpu_is_capturable_and_the_cpu_is_not():
    for training in (False, True):
        program = _program(training)._program
        assert _blocker(program) is None
        assert "not a CUDA GPU" in _blocker(program, device=torch.device("cpu"))


def test_environment_turns_capture_off(monkeypatch):
    program = _program(False)._program
    monkeypatch.setenv("POPTORCH_CUDA_GRAPHS", "0")
    assert "POPTORCH_CUDA_GRAPHS=0" in _blocker(program)


def test_adam_needs_capturable_state():
    model = Net()
    program = _program(True, torch.optim.Adam(model.parameters(), lr=1e-3),
                       model=model)._program
    reason = _blocker(program)
    assert "capturable=True" in reason and "Adam" in reason
    model = Net()
    program = _program(True, torch.optim.Adam(model.parameters(), lr=1e-3,
                                              capturable=True), model=model)._program
    assert _blocker(program) is None


def test_host_work_between_kernels_blocks_capture():
    model = Net()
    pop = _program(True, model=model)
    program = pop._program
    handle = program.binding.device.register_step_pre_hook(lambda *a: None)
    try:
        assert "hooks" in _blocker(program)
    finally:
        handle.remove()
    binding = program.binding
    binding.bind(binding.device, binding.sync, object())  # any loss scaler: the host
    assert "loss scaling" in _blocker(program)  # decides on each step
    binding.bind(binding.device, binding.sync, None)
    assert "anchored" in _blocker(program, anchors=lambda i: None)
    assert "floating-point" in _blocker(program, finite_check=lambda *a: None)
    assert _blocker(program) is None


def test_pipelined_model_is_not_captured():
    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = poptorch.BeginBlock(nn.Linear(6, 8), ipu_id=0)
            self.fc2 = poptorch.BeginBlock(nn.Linear(8, 3), ipu_id=1)

        def forward(self, x, y):
            out = self.fc2(F.relu(self.fc1(x)))
            return out, F.cross_entropy(out, y)
    opts = poptorch.Options().deviceIterations(2)
    opts.setExecutionStrategy(poptorch.PipelinedExecution())
    pop = _program(False, opts=opts, model=Two())
    program = pop._program
    assert "model parallelism" in _blocker(program)


def test_logs_why_once(caplog, monkeypatch):
    program = _program(False)._program
    spec = dataclasses.replace(program.spec, device=CUDA)
    monkeypatch.setenv("POPTORCH_CUDA_GRAPHS", "off")
    poptorch.setLogLevel("INFO")
    try:
        with caplog.at_level(logging.INFO, logger="poptorch"):
            for _ in range(2):
                assert cuda_graphs.cuda_graph_call(spec, program.binding) is None
    finally:
        poptorch.setLogLevel("WARN")
    lines = [r.getMessage() for r in caplog.records if "CUDA graph" in r.getMessage()]
    assert len(lines) == 1 and "POPTORCH_CUDA_GRAPHS=0" in lines[0]
    monkeypatch.delenv("POPTORCH_CUDA_GRAPHS")
    graphs = cuda_graphs.cuda_graph_call(spec, program.binding)
    assert isinstance(graphs, cuda_graphs.CudaGraphCall)
    # a CPU program runs without, silently
    assert cuda_graphs.cuda_graph_call(program.spec, program.binding) is None


def test_graph_key_records_again_on_what_a_graph_bakes_in():
    model = Net()
    pop = _program(True, model=model)
    program = pop._program
    binding = program.binding
    tensors = list(program.spec.params) + list(program.spec.buffers)
    backend = program.selector.eager
    x, y = _data()
    key = GraphKey(backend, binding, tensors, (x, y), {})
    assert key.stale(backend, binding, tensors) is None
    assert key.same_inputs(_data()[0:2], {})
    assert not key.same_inputs(_data(8), {})  # another shape: that call runs eagerly
    assert not key.same_inputs((x.double(), y), {})
    assert not key.same_inputs((x,), {"y": y})
    assert "backend" in key.stale(object(), binding, tensors)
    binding.device.param_groups[0]["lr"] = 0.5  # a learning rate synced from the host
    assert "hyperparameters" in key.stale(backend, binding, tensors)
    binding.device.param_groups[0]["lr"] = 0.1
    assert key.stale(backend, binding, tensors) is None
    device_model = pop._model
    with torch.no_grad():
        device_model.fc1.weight.add_(1.0)  # in place: the graph reads the same memory
    assert key.stale(backend, binding, tensors) is None
    device_model.fc1.weight.data = device_model.fc1.weight.data.clone()
    assert "storage" in key.stale(backend, binding, tensors)
    key = GraphKey(backend, binding, tensors, (x, y), {})
    pop.setOptimizer(torch.optim.SGD(model.parameters(), lr=0.2))
    assert "optimizer" in key.stale(backend, binding, tensors)


# ------------------------------------------------------------------ on a GPU only

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="CUDA graphs need a CUDA GPU (none found)")


@needs_cuda
@pytest.mark.parametrize("d,g", [(1, 1), (4, 2)])
def test_cuda_graph_training_matches_plain_pytorch(d, g):
    torch.manual_seed(0)
    model = Net()
    ref = copy.deepcopy(model).cuda()
    opts = poptorch.Options().deviceIterations(d)
    opts.Training.gradientAccumulation(g)
    opts.showCompilationProgressBar(False)
    opts.Jit.backend("eager")
    pop = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.05,
                                                              momentum=0.9))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    n = 4
    for _ in range(cuda_graphs.WARMUP_CALLS + 4):
        x, y = torch.randn(d * g * n, 6), torch.randint(0, 3, (d * g * n,))
        out, _loss = pop(x, y)
        xc, yc = x.cuda(), y.cuda()
        for i in range(d):
            ref_opt.zero_grad()
            rows = slice(i * g * n, (i + 1) * g * n)
            for xs, ys in zip(xc[rows].chunk(g), yc[rows].chunk(g), strict=False):
                ref_out, ref_loss = ref(xs, ys)
                (ref_loss / g).backward()
            ref_opt.step()
        torch.testing.assert_close(out, ref_out.detach().cpu(), rtol=1e-4, atol=1e-4)
    graphs = pop._program._graphs
    assert isinstance(graphs, cuda_graphs.CudaGraphCall) and graphs.replays >= 4
    assert graphs.captures == 1
    for p, r in zip(pop.model.parameters(), ref.parameters(), strict=False):
        torch.testing.assert_close(p, r.detach().cpu(), rtol=1e-4, atol=1e-4)


@needs_cuda
def test_cuda_graph_inference_and_fallback_for_host_ops(caplog):
    torch.manual_seed(0)
    model = Net().eval()
    opts = poptorch.Options().deviceIterations(4)
    opts.showCompilationProgressBar(False)
    opts.Jit.backend("eager")
    pop = poptorch.inferenceModel(model, opts)
    x, y = _data(16)
    with torch.no_grad():
        want = torch.cat([model(a, b)[0] for a, b in zip(x.chunk(4), y.chunk(4), strict=False)])
    for _ in range(cuda_graphs.WARMUP_CALLS + 3):
        torch.testing.assert_close(pop(x, y)[0], want, rtol=1e-4, atol=1e-4)
    assert pop._program._graphs.replays >= 3

    class HostOp(Net):
        def forward(self, x, y):
            out, loss = super().forward(x, y)
            if out.sum().item() > 1e9:  # a host read: cannot be captured
                out = out * 2
            return out, loss
    host = HostOp().eval()
    host.load_state_dict(model.state_dict())
    pop = poptorch.inferenceModel(host, opts.clone())
    poptorch.setLogLevel("INFO")
    try:
        with caplog.at_level(logging.INFO, logger="poptorch"):
            for _ in range(cuda_graphs.WARMUP_CALLS + 3):
                torch.testing.assert_close(pop(x, y)[0], want, rtol=1e-4, atol=1e-4)
    finally:
        poptorch.setLogLevel("WARN")
    assert pop._program._graphs.failed
    assert any("cannot be captured as a CUDA graph" in r.getMessage()
               for r in caplog.records)
