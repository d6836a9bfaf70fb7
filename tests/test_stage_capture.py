"""Stage-graph capture with torch.export (_runtime/placement/capture.py,
export_capture.py): ordinary code that torch.fx symbolic tracing cannot trace (sizes
read from the inputs: Graphcore's CLIP ``torch.zeros(x.shape[0], 1, x.shape[-1],
device=x.device, dtype=x.dtype)``) pipelines on the per-device engine; the fx tracer
takes what export cannot keep; what neither captures runs its stages one after another
with an INFO line saying what to change. Every model is compared with plain PyTorch
on the same data."""
import copy
import logging

import pytest
import torch

import poptorch
from poptorch import _logging
from poptorch._runtime.placement.capture import CaptureUnsupported, capture, trace_model
from poptorch._runtime.schedule.timeline import ENGINE, SEQUENTIAL

FEAT = 8


class Constructors(torch.nn.Module):
    """Two stages whose code builds tensors with sizes read from its inputs (CLIP's
    pattern, and ``ones`` / ``full`` / ``arange`` / ``new_zeros``)."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Linear(FEAT, FEAT)
        self.head = torch.nn.Linear(FEAT, FEAT)
        poptorch.BeginBlock(self.head, ipu_id=1)

    def forward(self, x, y):
        h = self.embed(x).unsqueeze(1)
        # CLIP: a class token of zeros, sized from the input
        cls = torch.zeros(h.shape[0], 1, h.shape[-1], device=h.device, dtype=h.dtype)
        h = torch.cat([cls + 0.5, h], dim=1)  # (B, 2, FEAT)
        scale = torch.ones(h.shape[0], h.shape[1], 1, device=h.device, dtype=h.dtype)
        bias = torch.full((h.shape[0], 1, h.shape[-1]), 0.25, device=h.device)
        h = (h * scale + bias).sum(dim=1)
        h = self.head(h)
        position = torch.arange(h.shape[-1], device=h.device, dtype=h.dtype)
        pad = h.new_zeros(h.shape[0], h.shape[-1])
        out = torch.tanh(h + position / h.shape[-1] + pad)
        return out, ((out - y)**2).mean()


class Reverse(torch.autograd.Function):
    """Gradient reversal: a backward an exported graph cannot keep."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return -grad


class Reversed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(FEAT, FEAT)
        self.b = torch.nn.Linear(FEAT, FEAT)
        poptorch.BeginBlock(self.b, ipu_id=1)

    def forward(self, x, y):
        h = Reverse.apply(torch.tanh(self.a(x)))
        out = self.b(h)
        return out, ((out - y)**2).mean()


class DataDependent(Constructors):
    """A Python branch on a tensor's value: no tracer captures it."""

    def forward(self, x, y):
        h = self.embed(x)
        if h.sum() > 0:
            h = h * 2
        out = self.head(h)
        return out, ((out - y)**2).mean()


class CheckpointedLoss(Constructors):
    """A recomputation checkpoint and an identity_loss in the captured graph."""

    def forward(self, x, y):
        h = self.embed(x)
        cls = torch.zeros(h.shape[0], h.shape[-1], device=h.device, dtype=h.dtype)
        h = poptorch.recomputationCheckpoint(torch.tanh(h + cls))
        out = self.head(h)
        return out, poptorch.identity_loss(((out - y)**2).mean(), reduction="mean")


def _runtime_of(strategy):
    return strategy.last_schedule.runtime


def _train_both(model, g=4, mb=2, steps=3, recompute=False):
    """Train a pipelined poptorch copy and a plain PyTorch copy on the same data;
    compare outputs and weights after every step; returns the runtimes used."""
    reference = copy.deepcopy(model)
    strategy = poptorch.PipelinedExecution()
    opts = poptorch.Options()
    opts.Training.gradientAccumulation(g)
    opts.outputMode(poptorch.OutputMode.All)
    opts.setExecutionStrategy(strategy)
    if recompute:
        opts._Popart.set("autoRecomputation", 3)
    training = poptorch.trainingModel(model, opts,
                                      torch.optim.SGD(model.parameters(), lr=0.1))
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    torch.manual_seed(0)
    runtimes = []
    for step in range(steps):
        x, y = torch.randn(g * mb, FEAT), torch.randn(g * mb, FEAT)
        out, _ = training(x, y)
        runtimes.append(_runtime_of(strategy))
        ref_opt.zero_grad()
        ref_outs = []
        for m in range(g):
            sl = slice(m * mb, (m + 1) * mb)
            ref_out, loss = reference(x[sl], y[sl])
            (loss / g).backward()
            ref_outs.append(ref_out.detach())
        ref_opt.step()
        torch.testing.assert_close(out, torch.cat(ref_outs), rtol=0, atol=1e-5)
        training.copyWeightsToHost()
        for (name, p), q in zip(model.named_parameters(), reference.parameters(),
                                strict=True):
            assert (p.detach() - q.detach()).abs().max() <= 1e-5, (step, name)
    return runtimes


def test_fx_cannot_trace_the_clip_pattern_export_captures_it():
    """The reproduction of the CLIP log: fx fails on it, capture() takes export."""
    model = Constructors()
    x, y = torch.randn(4, FEAT), torch.randn(4, FEAT)
    with pytest.raises(TypeError, match="zeros"):
        trace_model(model, (x, y), {}, poptorch.PipelinedExecution())
    captured = capture(model, (x, y), {}, poptorch.PipelinedExecution())
    assert captured.tracer == "torch.export"
    assert captured.trace.sequence == ["<before first block>", "0"]
    assert captured.trace.ipu_of["0"] == 1
    # the graph computes what the model computes, for the captured shapes and for a
    # micro-batch's (dimension 0 captured symbolic, from 2 up)
    assert captured.inputs_of((torch.randn(1, FEAT), torch.randn(1, FEAT)), {}) is None
    for batch in (4, 2, 3):
        xb, yb = torch.randn(batch, FEAT), torch.randn(batch, FEAT)
        inputs = captured.inputs_of((xb, yb), {})
        assert inputs is not None
        got = captured.graph_module(**inputs)
        want = model(xb, yb)
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_calls_unlike_the_captured_ones_are_refused_by_the_guard():
    model = Constructors()
    x, y = torch.randn(4, FEAT), torch.randn(4, FEAT)
    captured = capture(model, (x, y), {}, poptorch.PipelinedExecution())
    assert captured.inputs_of((torch.randn(4, FEAT + 1), y), {}) is None  # a size
    assert captured.inputs_of((x.double(), y.double()), {}) is None  # a dtype
    assert captured.inputs_of((x, torch.randn(3, FEAT)), {}) is None  # batches differ
    assert captured.inputs_of((x[None], y), {}) is None  # a rank


def test_a_device_read_from_an_input_follows_the_stage():
    """``device=h.device`` is not baked in: on other devices the graph builds its
    tensors there (the meta device plays a stage's device)."""
    model = Constructors()
    x, y = torch.randn(4, FEAT), torch.randn(4, FEAT)
    captured = capture(model, (x, y), {}, poptorch.PipelinedExecution())
    gm = copy.deepcopy(captured.graph_module).to("meta")
    out, loss = gm(x.to("meta"), y.to("meta"))
    assert out.device.type == "meta" and loss.device.type == "meta"
    assert out.shape == (4, FEAT)


@pytest.mark.parametrize("model_class", [Constructors, CheckpointedLoss])
def test_shape_from_input_constructors_pipeline_on_the_engine(model_class):
    """2 IPUs, g=4, training: every call on the per-device engine, as plain PyTorch."""
    torch.manual_seed(1)
    runtimes = _train_both(model_class(), recompute=model_class is CheckpointedLoss)
    assert runtimes == [ENGINE] * 3


def test_shape_from_input_constructors_pipeline_inference_on_the_engine():
    torch.manual_seed(2)
    model = Constructors()
    reference = copy.deepcopy(model)
    strategy = poptorch.PipelinedExecution()
    opts = poptorch.Options()
    opts.deviceIterations(4)
    opts.outputMode(poptorch.OutputMode.All)
    opts.setExecutionStrategy(strategy)
    inference = poptorch.inferenceModel(model, opts)
    for _ in range(3):
        x, y = torch.randn(8, FEAT), torch.randn(8, FEAT)
        out, _ = inference(x, y)
        assert _runtime_of(strategy) == ENGINE
        with torch.no_grad():
            want = torch.cat([reference(x[k:k + 2], y[k:k + 2])[0] for k in range(0, 8, 2)])
        torch.testing.assert_close(out, want, rtol=0, atol=1e-5)


def test_a_custom_backward_is_not_captured_and_its_gradients_are_kept():
    """Export and fx record a torch.autograd.Function's forward only: such a model
    is not captured, and its stages' gradients follow the backward (as PyTorch's)."""
    torch.manual_seed(3)
    model = Reversed()
    x, y = torch.randn(4, FEAT), torch.randn(4, FEAT)
    with pytest.raises(CaptureUnsupported, match="ReverseBackward"):
        capture(model, (x, y), {}, poptorch.PipelinedExecution())
    assert trace_model(model, (x, y), {}, poptorch.PipelinedExecution())  # (fx: no error)
    assert _train_both(model) == [SEQUENTIAL] * 3


def test_what_no_tracer_captures_runs_sequentially_and_says_what_to_change(
        caplog, monkeypatch):
    monkeypatch.setattr(_logging, "_once_keys", set())
    caplog.set_level(logging.INFO, logger="poptorch::python")
    model = DataDependent()
    x, y = torch.randn(4, FEAT), torch.randn(4, FEAT)
    with pytest.raises(CaptureUnsupported) as info:
        capture(model, (x, y), {}, poptorch.PipelinedExecution())
    assert "torch.export" in str(info.value) and "torch.fx" in str(info.value)
    torch.manual_seed(4)
    assert _train_both(model) == [SEQUENTIAL] * 3
    lines = [r.getMessage() for r in caplog.records
             if "one after another" in r.getMessage()]
    assert len(lines) == 1
    assert "torch.where" in lines[0] and "torch.export" in lines[0]


def test_capture_leaves_the_models_attributes_in_place():
    """Non-strict export puts copies of a module's containers in their place; the
    capture gives the module its own objects back (a user's reference stays live)."""
    model = Constructors()
    flags = {"scale": 1.0}
    model.flags = flags
    captured = capture(model, (torch.randn(4, FEAT), torch.randn(4, FEAT)), {},
                       poptorch.PipelinedExecution())
    assert captured.tracer == "torch.export"
    assert model.flags is flags


class BranchOnBatch(Constructors):
    """A Python branch on the batch size: export takes it for sizes 2 and up, so a
    micro-batch of 1 is refused by the guard (its stages run one after another)."""

    def forward(self, x, y):
        h = self.embed(x)
        if h.shape[0] > 1:
            h = h - h.mean(dim=0, keepdim=True)
        out = self.head(h)
        return out, ((out - y)**2).mean()


def test_a_branch_on_the_batch_size_captures_for_the_sizes_it_allows():
    model = BranchOnBatch()
    captured = capture(model, (torch.randn(8, FEAT), torch.randn(8, FEAT)), {},
                       poptorch.PipelinedExecution())
    assert captured.tracer == "torch.export"
    assert captured.trace.sequence == ["<before first block>", "0"]
    assert captured.inputs_of((torch.randn(1, FEAT), torch.randn(1, FEAT)), {}) is None
    x, y = torch.randn(3, FEAT), torch.randn(3, FEAT)
    inputs = captured.inputs_of((x, y), {})
    for got, want in zip(captured.graph_module(**inputs), model(x, y), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
