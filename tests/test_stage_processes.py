"""Stages on processes (``Options.Distributed.stagesOnProcesses``): a 2-stage pipelined
model trained by ``torchrun --standalone --nproc_per_node=2`` (gloo, one thread per
process; tests/stage_process_worker.py), one stage per process, compared with plain
PyTorch on the same data from the same initial weights; and the inputs it refuses.
"""
from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest
import torch

import poptorch
from _stage_process_cases import (CALLS, G, M, OUTPUT_MODES, SCHEDULES, Net, batch,
                                  make_model, options, plain_reference)
from test_distributed import _check, _env

HERE = pathlib.Path(__file__).resolve().parent
WORKER = HERE / "stage_process_worker.py"
TOL = 1e-5


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("stages")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc_per_node=2", str(WORKER), str(out)]
    result = subprocess.run(cmd, cwd=HERE, env=_env(), capture_output=True, text=True,
                            timeout=120)
    _check(result)
    assert "Warning" not in result.stderr, result.stderr[-3000:]
    return out


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_stage_processes_train_like_plain_pytorch(trained, schedule):
    reference = make_model(1000, annotate=False)  # process 0's initial weights
    outputs, losses = plain_reference(reference)
    expected = reference.state_dict()
    for rank in (0, 1):
        got = torch.load(trained / f"{schedule}_rank{rank}.pt", weights_only=False)
        # every stage's trained weights on every process (copyWeightsToHost gathers)
        assert got["state"].keys() == expected.keys()
        for name, value in expected.items():
            diff = (got["state"][name] - value).abs().max().item()
            assert diff <= TOL, f"rank {rank}: {name} differs by {diff}"
        # the outputs and losses PopTorch returns, on every process: every micro-batch's
        # (OutputMode.All), or the last one's (Final, the default for training)
        assert len(got["losses"]) == CALLS
        final = OUTPUT_MODES[schedule] != "All"
        for call in range(CALLS):
            want_loss = losses[call][-1] if final else losses[call]
            want_out = outputs[call][-M:] if final else outputs[call]
            assert got["losses"][call].shape == want_loss.shape
            assert got["outputs"][call].shape == want_out.shape
            assert (got["losses"][call] - want_loss).abs().max().item() <= TOL
            assert (got["outputs"][call] - want_out).abs().max().item() <= TOL
        # the schedule the processes ran, on the user's strategy object
        order = got["schedule"][1]
        if schedule == "GPipe":
            assert order == [("F", m) for m in range(G)] + [("B", m) for m in range(G)]
        else:
            assert order[:2] == [("F", 0), ("B", 0)]


def test_stage_processes_infer_like_plain_pytorch(trained):
    reference = make_model(1000, annotate=False)
    plain_reference(reference)  # the weights the inference model was made from
    x, y = batch(CALLS)
    x, y = torch.cat([x, x * 2]), torch.cat([y, y])
    rows = G * M  # one micro-batch per device iteration
    with torch.no_grad():
        expected = [reference(x[i * rows:(i + 1) * rows], y[i * rows:(i + 1) * rows])
                    for i in range(2)]
    for rank in (0, 1):
        out, loss = torch.load(trained / f"inference_rank{rank}.pt", weights_only=False)
        assert out.shape == (2 * rows, 3) and loss.shape == (2, )
        assert (out - torch.cat([o for o, _ in expected])).abs().max().item() <= TOL
        assert (loss - torch.stack([l for _, l in expected])).abs().max().item() <= TOL


def _train(model, strategy, **kwargs):
    opts = options(strategy, stage_processes=True)
    for name, value in kwargs.items():
        getattr(opts, name)(value)
    training = poptorch.trainingModel(model, opts,
                                      torch.optim.SGD(model.parameters(), lr=0.1))
    return training


def test_one_process_for_two_stages_is_refused():
    model = make_model(0, annotate=True)
    training = _train(model, poptorch.PipelinedExecution())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(poptorch.Error, match=r"2 stages but the run has 1 process.*"
                       r"multiple of the stages.*nproc_per_node=2"):
        training(*batch(0))
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), f"{name} changed"


def test_a_strategy_that_is_not_pipelined_is_refused():
    training = _train(make_model(0, annotate=True), poptorch.ShardedExecution())
    with pytest.raises(poptorch.Error, match="needs a pipelined model.*ShardedExecution"):
        training(*batch(0))


@pytest.mark.parametrize("name", ["Interleaved1F1B", "ZeroBubble"])
def test_schedules_of_several_stages_per_device_are_refused(name):
    training = _train(make_model(0, annotate=True),
                      poptorch.PipelinedExecution().setSchedule(name))
    with pytest.raises(poptorch.Error, match=f"{name} schedule.*GPipe and 1F1B"):
        training(*batch(0))


def test_local_replicas_are_refused():
    training = _train(make_model(0, annotate=True), poptorch.PipelinedExecution(),
                      replicationFactor=2)
    with pytest.raises(poptorch.Error, match=r"replicationFactor\(2\).*more processes"):
        x, y = batch(0)
        training(torch.cat([x, x]), torch.cat([y, y]))


def test_automatic_loss_scaling_is_refused():
    model = make_model(0, annotate=True)
    opts = options(poptorch.PipelinedExecution(), stage_processes=True)
    opts.Training.setAutomaticLossScaling(True)
    training = poptorch.trainingModel(
        model, opts, poptorch.optim.SGD(model.parameters(), lr=0.1, loss_scaling=8.0))
    with pytest.raises(poptorch.Error, match="AutomaticLossScaling.*fixed loss scale"):
        training(*batch(0))


class DataDependent(Net):
    def forward(self, x, y):
        h = torch.relu(self.l1(x))
        if h.sum() > 0:  # control flow on a tensor's value: not capturable
            h = h * 2
        out = self.l3(torch.tanh(self.l2(h)))
        return out, torch.nn.functional.cross_entropy(out, y)


def test_a_model_that_cannot_be_captured_is_refused():
    torch.manual_seed(0)
    model = DataDependent()
    poptorch.BeginBlock(model.l1, "s0", ipu_id=0)
    poptorch.BeginBlock(model.l2, "s1", ipu_id=1)
    training = _train(model, poptorch.PipelinedExecution())
    with pytest.raises(poptorch.Error, match="cannot be captured.*traceable by torch.fx"):
        training(*batch(0))


def test_the_option_is_ours_and_off_by_default():
    opts = poptorch.Options()
    assert opts.Distributed.stages_on_processes is False
    assert "stages_on_processes" not in opts.toDict()["Distributed"]
    opts.Distributed.stagesOnProcesses()
    assert opts.Distributed.stages_on_processes is True
    with pytest.raises(poptorch.Error, match="expected True or False"):
        poptorch.Options().Distributed.stagesOnProcesses("yes")


class Skip3(torch.nn.Module):
    """Three stages; stage 2 reads stage 0's output (it must pass through stage 1)."""

    def __init__(self, size_crosses: bool = False) -> None:
        super().__init__()
        self.l1 = torch.nn.Linear(4, 4)
        self.l2 = torch.nn.Linear(4, 4)
        self.l3 = torch.nn.Linear(4, 2)
        self.size_crosses = size_crosses
        poptorch.BeginBlock(self.l1, "s0", ipu_id=0)
        poptorch.BeginBlock(self.l2, "s1", ipu_id=1)
        poptorch.BeginBlock(self.l3, "s2", ipu_id=2)

    def forward(self, x, y):
        a = torch.relu(self.l1(x))
        n = a.size(0)  # an int made in stage 0
        b = torch.tanh(self.l2(a))
        if self.size_crosses:
            b = b.reshape(n, -1)  # ... read by stage 1: cannot travel between processes
        out = self.l3(b) + a[:, :2]  # (after l3 starts stage 2)
        return out, torch.nn.functional.mse_loss(out, y)


def _adapters(model, x, y):
    from poptorch._runtime.config import RuntimeConfig
    from poptorch._runtime.placement.capture import capture
    from poptorch._runtime.placement.partition import resolve_partition
    from poptorch._runtime.placement.processes import _plan_adapters
    from poptorch._runtime.placement.stages import split_stages
    strategy = poptorch.PipelinedExecution()
    opts = poptorch.Options()
    opts.Training.gradientAccumulation(8)
    captured = capture(model, (x, y), {}, strategy)
    part = resolve_partition(captured.trace, strategy, RuntimeConfig.of(opts), True)
    return _plan_adapters(split_stages(captured, part))


def _chain(adapters, inputs):
    # as torch's schedule.step() hands them: each micro-batch's inputs with a leading
    # unit dimension (its chunk of the stacked step); the last stage's outputs have one
    carried: tuple = ()
    for adapter in adapters:
        needs = {name: inputs[name].unsqueeze(0)
                 for kind, name in adapter.in_plan if kind == "input"}
        carried = adapter(*carried, **needs)
    return tuple(value[0] for value in carried)


def test_stage_adapters_pass_skipped_values_through_the_stages_between():
    # three stages chained in one process as the processes would run them: stage 1 hands
    # on stage 0's value that stage 2 reads; gradients flow back through the hand-on
    torch.manual_seed(0)
    model = Skip3()
    x, y = torch.randn(3, 4), torch.randn(3, 2)
    adapters = _adapters(model, x, y)
    assert [kind for kind, _ in adapters[1].out_plan].count("carry") == 1
    out, loss = _chain(adapters, {"x": x, "y": y})
    expected_out, expected_loss = model(x, y)
    assert torch.allclose(out, expected_out) and torch.allclose(loss, expected_loss)
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    expected_loss.backward()
    for got, want in zip(grads, [p.grad for p in model.parameters()], strict=True):
        assert torch.allclose(got, want)


def test_a_size_read_in_one_stage_and_used_in_the_next_is_recomputed_there():
    # torch.export captures the size as a graph value of the stage that uses it: nothing
    # but tensors crosses, and the chained stages equal the model
    torch.manual_seed(0)
    model = Skip3(size_crosses=True)
    x, y = torch.randn(3, 4), torch.randn(3, 2)
    out, loss = _chain(_adapters(model, x, y), {"x": x, "y": y})
    ref_out, ref_loss = model(x, y)
    torch.testing.assert_close(out, ref_out, rtol=0, atol=0)
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0)


def test_a_non_tensor_crossing_stages_is_refused():
    torch.manual_seed(0)
    model = Skip3(size_crosses=True)
    # a module hook of the user's makes the capture trace with torch.fx first, whose
    # graph hands the int made in stage 0 to stage 1
    model.l1.register_forward_hook(lambda module, args, output: None)
    x, y = torch.randn(3, 4), torch.randn(3, 2)
    with pytest.raises(poptorch.Error, match="stage 0 hands int 3 to a later stage.*"
                       "only tensors travel between processes"):
        _chain(_adapters(model, x, y), {"x": x, "y": y})


