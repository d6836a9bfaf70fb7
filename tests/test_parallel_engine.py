"""The model-parallel execution engine (_runtime/placement/engine.py) against plain PyTorch:
weights after training for every strategy and schedule, last_schedule on the user's
strategy object, stage boundaries with skips and identity_loss, errors, fallbacks."""
import copy

import pytest
import torch

import poptorch
from poptorch._runtime.schedule.schedules import Topology, device_lanes, one_f_one_b
from poptorch._runtime.config import RuntimeConfig
from poptorch._runtime.placement.build import build_runner

FEAT = 8


class Chain(torch.nn.Module):
    """``n`` Linear+tanh layers, BeginBlock on each (layer k -> IPU ipus[k])."""

    def __init__(self, ipus):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(FEAT, FEAT) for _ in ipus)
        for k, (layer, ipu) in enumerate(zip(self.layers, ipus, strict=False)):
            poptorch.BeginBlock(layer, f"b{k}", ipu)

    def forward(self, x, y):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x, ((x - y)**2).mean()


class Skips(torch.nn.Module):
    """Values cross more than one boundary: a residual from stage 0 into stage 2, and
    the output reads a stage-0 value too."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(FEAT, FEAT)
        self.b = torch.nn.Linear(FEAT, FEAT)
        self.c = torch.nn.Linear(FEAT, FEAT)

    def forward(self, x, y):
        with poptorch.Block("a", ipu_id=0):
            h = torch.relu(self.a(x))
        with poptorch.Block("b", ipu_id=1):
            g = torch.tanh(self.b(h))
        with poptorch.Block("c", ipu_id=2):
            out = self.c(g) + h
        with poptorch.Block("d", ipu_id=3):
            loss = poptorch.identity_loss(((out - y)**2).sum() + h.mean(), "mean")
        return out, h, loss


class Dynamic(torch.nn.Module):
    """Data-dependent control flow: cannot be captured (its stages run one after another
    in the calling thread)."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(FEAT, FEAT)
        self.b = torch.nn.Linear(FEAT, FEAT)

    def forward(self, x, y):
        with poptorch.Block("a", ipu_id=0):
            x = self.a(x)
            if x.sum() > 0:
                x = x * 2
        with poptorch.Block("b", ipu_id=1):
            x = self.b(x)
        return x, ((x - y)**2).mean()


def _runner_of(model):
    runner = model._program.runner
    while not hasattr(runner, "partition") and hasattr(runner, "inner"):
        runner = runner.inner
    return runner


def _train_both(model, strategy, g, steps=3, loss_index=-1, mb=2, configure=None):
    """Train a poptorch copy and a plain PyTorch copy on the same data; return both
    models and the poptorch training model (``configure(opts)``: more options)."""
    reference = copy.deepcopy(model)
    poptorch.removeBlocks(reference)
    opts = poptorch.Options()
    opts.Training.gradientAccumulation(g)
    if configure is not None:
        configure(opts)
    if strategy is not None:
        opts.setExecutionStrategy(strategy)
    training = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.1))
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    torch.manual_seed(0)
    for _ in range(steps):
        x, y = torch.randn(g * mb, FEAT), torch.randn(g * mb, FEAT)
        training(x, y)
        ref_opt.zero_grad()
        for m in range(g):
            sl = slice(m * mb, (m + 1) * mb)
            (reference(x[sl], y[sl])[loss_index] / g).backward()
        ref_opt.step()
    training.copyWeightsToHost()
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=False):
        assert (p.detach() - q.detach()).abs().max() <= 1e-5, name
    return training


def _schedules():
    return {
        "1F1B": lambda: poptorch.PipelinedExecution(),
        "GPipe": lambda: poptorch.PipelinedExecution().setSchedule("GPipe"),
        "sharded": lambda: poptorch.ShardedExecution(),
    }


@pytest.mark.parametrize("name", ["1F1B", "GPipe", "sharded"])
@pytest.mark.parametrize("ipus", [[0, 1], [0, 1, 2, 3]])
def test_engine_weights_match_pytorch(name, ipus):
    strategy = _schedules()[name]()
    g = 2 * len(ipus)
    training = _train_both(Chain(ipus), strategy, g)
    runner = _runner_of(training)
    assert runner.engine is not None  # split into stage modules, run by the engine
    assert len(runner.engine.staged.stages) == len(ipus)
    record = strategy.last_schedule  # the user's own object
    assert record is runner.last_schedule and record.runtime == "engine"
    assert len(record.events) == 2 * g * len(ipus)
    for s in range(len(ipus)):
        order = record.stage_order(s)
        assert sorted(order) == sorted([("F", m) for m in range(g)] +
                                       [("B", m) for m in range(g)])
    if name == "GPipe":
        assert record.stage_order(0) == [("F", m) for m in range(g)] + \
            [("B", m) for m in range(g)]


def test_interleaved_stages_on_shared_devices_match_pytorch():
    """4 stages on 2 IPUs (AutoIncrement): each device's worker runs two stages, in
    the merged (interleaved) order."""
    strategy = poptorch.PipelinedExecution(poptorch.AutoStage.AutoIncrement)
    training = _train_both(Chain([0, 1, 0, 1]), strategy, 8)
    runner = _runner_of(training)
    assert [s.ipu for s in runner.partition.stages] == [0, 1, 0, 1]
    assert sorted(runner.engine.workers) == [0, 1]
    lanes = {e.lane for e in strategy.last_schedule.events}
    assert lanes == {0, 1}


@pytest.mark.parametrize("name", ["1F1B", "sharded"])
def test_skip_connections_and_identity_loss(name):
    strategy = _schedules()[name]()
    training = _train_both(Skips(), strategy, 8)
    runner = _runner_of(training)
    assert runner.engine is not None
    stages = runner.engine.staged.stages
    assert stages[2].producers == [0, 1]  # the residual crosses two boundaries


@pytest.mark.parametrize("strategy", [
    lambda: poptorch.SerialPhasedExecution(poptorch.Phase(poptorch.Stage("a")),
                                           poptorch.Phase(poptorch.Stage("b"))),
    lambda: poptorch.ParallelPhasedExecution(poptorch.Phase(poptorch.Stage("a")),
                                             poptorch.Phase(poptorch.Stage("b"))),
    lambda: poptorch.PipelinedExecution()
], ids=["serial_phased", "parallel_phased", "uncapturable_pipeline"])
def test_uncapturable_models_run_sequentially_and_match_pytorch(strategy):
    strategy = strategy()
    training = _train_both(Dynamic(), strategy, 4)
    assert _runner_of(training).engine is None
    record = strategy.last_schedule
    assert record.runtime == "sequential"
    for unit in range(2):  # each micro-batch forward through both units, then back
        assert record.stage_order(unit) == [(k, m) for m in range(4) for k in "FB"]


def test_last_schedule_reaches_the_users_strategy_object():
    strategy = poptorch.PipelinedExecution()
    opts = poptorch.Options().setExecutionStrategy(strategy)
    opts.Training.gradientAccumulation(4)
    model = Chain([0, 1])
    training = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.1))
    assert strategy.last_schedule is None
    training(torch.randn(8, FEAT), torch.randn(8, FEAT))
    assert strategy.last_schedule is not None
    assert "bubble fraction" in str(strategy.last_schedule)
    # the options the model holds are a copy; both show the schedule
    assert training.options._execution_strategy is not strategy
    assert training.options._execution_strategy.last_schedule is strategy.last_schedule


def test_partition_is_known_before_the_first_step():
    """With an example call, the model is captured and split when the runner is built:
    stages, devices and weight placement exist before any step."""
    opts = poptorch.Options()
    opts.Training.gradientAccumulation(4)
    model = Chain([0, 1])
    example = ((torch.randn(2, FEAT), torch.randn(2, FEAT)), {})
    runner = build_runner(model, RuntimeConfig.of(opts), True, example=example)
    assert runner.partition is not None and runner.engine is not None
    assert [s.ipu for s in runner.partition.stages] == [0, 1]
    assert runner.devices is not None and len(runner.devices) >= 2


def test_inference_pipeline_matches_pytorch():
    model = Chain([0, 1]).eval()
    reference = copy.deepcopy(model)
    opts = poptorch.Options()
    opts.deviceIterations(4)
    inference = poptorch.inferenceModel(model, opts)
    x, y = torch.randn(8, FEAT), torch.randn(8, FEAT)
    out, _ = inference(x, y)
    assert _runner_of(inference).engine is not None
    with torch.no_grad():
        ref = torch.cat([reference(x[2 * i:2 * i + 2], y[2 * i:2 * i + 2])[0]
                         for i in range(4)])
    assert torch.allclose(out, ref, atol=1e-6)


def test_error_in_a_stage_propagates_and_the_engine_recovers():
    opts = poptorch.Options()
    opts.Training.gradientAccumulation(4)
    model = Chain([0, 1])
    runner = build_runner(model, RuntimeConfig.of(opts), True)
    good = [((torch.randn(2, FEAT), torch.randn(2, FEAT)), {}) for _ in range(4)]
    runner(good, lambda out: out[1])
    bad = [((torch.randn(2, FEAT + 1), torch.randn(2, FEAT)), {}) for _ in range(4)]
    with pytest.raises(RuntimeError, match="shapes"):
        runner(bad, lambda out: out[1])
    runner(good, lambda out: out[1])  # the workers are still there
    assert len(runner.last_schedule.events) == 16


def test_device_lanes_run_every_action_once_in_dependency_order():
    per_stage = one_f_one_b(4, 8)
    lanes = device_lanes(per_stage, [0, 1, 0, 1], 2, Topology.chain(4))
    ops = [op._replace(lane=-1) for lane in lanes for op in lane]
    assert sorted(ops) == sorted(op for lane in per_stage for op in lane)
    for stage in range(4):  # each stage keeps its own 1F1B order, on its device
        lane = lanes[stage % 2]
        assert [op._replace(lane=-1) for op in lane if op.stage == stage] == per_stage[stage]
        assert {op.lane for op in lane} == {stage % 2}


@pytest.mark.parametrize("kind", ["serial", "parallel"])
def test_phased_on_the_engine_streams_weights_and_matches_pytorch(kind):
    cls = poptorch.SerialPhasedExecution if kind == "serial" else \
        poptorch.ParallelPhasedExecution
    strategy = cls(*[poptorch.Phase(poptorch.Stage(f"b{k}")) for k in range(4)])
    if kind == "serial":
        strategy.setTensorsLiveness(poptorch.Liveness.OffChipAfterEachPhase)
    model = Chain([None] * 4)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    training = _train_both(model, strategy, 2)
    runner = _runner_of(training)
    assert runner.engine is not None
    mem = runner.streaming
    plan = strategy.last_schedule.plan
    loads = [[op.stage for op in lane if op.kind == "LOAD"] for lane in plan.lanes]
    if kind == "serial":  # one phase of four resident at a time
        assert mem.peak_resident_bytes == total // 4
        # the schedule's LOAD actions moved the weights: each phase loaded once per
        # pass (the last forward phase stays for its backward), in the plan's order
        assert loads == [[0, 1, 2, 3, 2, 1, 0]]
        assert mem.loads == loads[0] * 3
    else:  # AlwaysLive (parallel phases have no liveness setting): all resident
        assert mem.peak_resident_bytes == total
        assert {e.lane for e in strategy.last_schedule.events} == {0, 1}
        assert loads[:2] == [[0, 2, 0], [1, 3, 1]] and mem.loads == []
    assert not any(mem.resident.values())  # every streamed phase stored after the step
    assert len(strategy.last_schedule.events) == 2 * 2 * 4


def test_off_chip_weights_stream_in_phases_that_would_stay_live():
    # ParallelPhasedExecution keeps every phase live; weights kept off chip
    # (TensorLocations.setWeightLocation) stream in and out with their phase all the same
    strategy = poptorch.ParallelPhasedExecution(
        *[poptorch.Phase(poptorch.Stage(f"b{k}")) for k in range(4)])
    model = Chain([None] * 4)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    off_chip = poptorch.TensorLocationSettings().useOnChipStorage(False)
    training = _train_both(model, strategy, 2, configure=lambda opts:
                           opts.TensorLocations.setWeightLocation(off_chip))
    mem = _runner_of(training).streaming
    assert 0 < mem.peak_resident_bytes < total
    # each lane's LOAD / STORE actions: phase 2 (lane 0) and 3 (lane 1) stay loaded
    # from their forward to their backward
    assert sorted(mem.loads[:6]) == [0, 0, 1, 1, 2, 3]


class CheckpointedChain(Chain):
    def forward(self, x, y):
        for layer in self.layers:
            x = poptorch.recomputationCheckpoint(torch.tanh(layer(x)) * 2.0)
        return x, ((x.exp() - y)**2).mean()


@pytest.mark.parametrize("name", ["1F1B", "sharded"])
def test_recomputation_per_stage_on_the_engine(name):
    strategy = _schedules()[name]()
    training = _train_both(CheckpointedChain([0, 1]), strategy, 4)
    runner = _runner_of(training)
    assert runner.engine is not None
    assert all(s.checkpoints for s in runner.engine.staged.stages)


class _ThreeBlocks(torch.nn.Module):
    def forward(self, x, y):
        with poptorch.Block("A"):
            c = x + x
        with poptorch.Block("B"):
            d = y + y
        with poptorch.Block("C"):
            e = x * 3
        return c, d, e


def test_phases_of_different_widths_with_explicit_ipus_match_plain_pytorch():
    """Upstream's user guide: phase 0 has one stage, phase 1 two, every stage placed with
    .ipu(n); accepted, and the outputs are plain PyTorch's."""
    x, y = torch.rand(4, 1), torch.rand(4, 1)
    first = poptorch.Phase(poptorch.Stage("A").ipu(0))
    second = poptorch.Phase(poptorch.Stage("B").ipu(1), poptorch.Stage("C").ipu(3))
    opts = poptorch.Options().autoRoundNumIPUs(True)
    opts.setExecutionStrategy(poptorch.ParallelPhasedExecution(first, second))
    model = _ThreeBlocks()
    outs = poptorch.inferenceModel(model, opts)(x, y)
    for out, ref in zip(outs, model(x, y), strict=False):
        torch.testing.assert_close(out, ref)


def test_phases_of_different_widths_with_automatic_ipus_are_refused():
    first = poptorch.Phase(poptorch.Stage("A"))
    second = poptorch.Phase(poptorch.Stage("B"), poptorch.Stage("C"))
    opts = poptorch.Options().autoRoundNumIPUs(True)
    opts.setExecutionStrategy(poptorch.ParallelPhasedExecution(first, second))
    x = torch.rand(4, 1)
    with pytest.raises(poptorch.Error, match="has 2 stage.s. but phase 0 has 1"):
        poptorch.inferenceModel(_ThreeBlocks(), opts)(x, x)
