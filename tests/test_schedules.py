"""Every execution strategy and pipeline schedule (_runtime/schedule/schedules.py)
against plain PyTorch, and every schedule's action lists checked for dependencies.

* the action lists: each schedule, over stage counts, placements and micro-batch
  counts, runs every action once and none before what it consumes
  (``schedules.check_dependencies``, which is shown to fail on a bad order);
* training: strategy x schedule x (deviceIterations, gradientAccumulation,
  replicationFactor) x backend, 3 steps: the outputs and the weights equal a plain
  PyTorch loop on the same data within 1e-5; ``model.schedule`` shows the plan run.
"""
import copy
import itertools

import pytest
import torch

import poptorch
from poptorch._runtime.schedule import schedules
from poptorch._runtime.schedule.actions import Action, ActionKind
from poptorch._runtime.schedule.timeline import Timeline

FEAT, MB = 4, 2
F, B = ActionKind.FORWARD, ActionKind.BACKWARD
IH, W = ActionKind.INPUT_HALF, ActionKind.WEIGHT_HALF


# ------------------------------------------------------------------ action lists
def _covers(lanes, stages, count, training):
    """Each (stage, micro-batch) has one F and, training, one B or an I and its W (a
    phased schedule's LOAD / STORE actions, which repeat, are checked apart)."""
    ops = [(op.kind, op.stage, op.microbatch) for lane in lanes for op in lane
           if op.kind not in (ActionKind.LOAD, ActionKind.STORE)]
    assert len(ops) == len(set(ops))
    for s in range(stages):
        for m in range(count):
            assert (F, s, m) in ops
            if training:
                assert ((B, s, m) in ops) != ((IH, s, m) in ops and (W, s, m) in ops)


PLACEMENTS = [[0, 1], [0, 1, 2], [0, 1, 0, 1], [0, 1, 2, 0, 1, 2], [0, 0, 1, 1]]


@pytest.mark.parametrize("name", schedules.SCHEDULES)
@pytest.mark.parametrize("placement", PLACEMENTS, ids=str)
@pytest.mark.parametrize("count", [3, 9])
@pytest.mark.parametrize("training", [True, False])
def test_pipeline_action_lists_respect_dependencies(name, placement, count, training):
    topo = schedules.Topology.chain(len(placement))
    lanes = schedules.pipeline_lanes(name, topo, placement, max(placement) + 1, count,
                                     training)
    schedules.check_dependencies(lanes, topo)
    _covers(lanes, len(placement), count, training)
    for d, lane in enumerate(lanes):  # each action on its stage's device
        assert all(op.lane == d and placement[op.stage] == d for op in lane)


def test_skip_connections_and_one_lane_schedules_respect_dependencies():
    skip = schedules.Topology.of([[], [0], [0, 1]])  # stage 2 reads stages 0 and 1
    for name in schedules.SCHEDULES:
        lanes = schedules.pipeline_lanes(name, skip, [0, 1, 2], 3, 6, True)
        schedules.check_dependencies(lanes, skip)
        _covers(lanes, 3, 6, True)
    chain = schedules.Topology.chain(4)
    for lanes in ([schedules.sharded(4, 5, True)],
                  [schedules.serial_phased([0, 1, 2, 3], 5, True)],
                  schedules.parallel_phased(4, 5, True, [0, 1, 2, 3], 4)):
        schedules.check_dependencies(lanes, chain)
        _covers(lanes, 4, 5, True)


def test_phased_schedules_load_each_phase_around_its_actions():
    """Graphcore's load / compute / store phases: a lane loads a phase's weights before
    its actions and stores them after; the last forward phase stays for its backward."""
    LOAD, STORE = ActionKind.LOAD, ActionKind.STORE
    lane = schedules.serial_phased([0, 1], 2, True)
    assert [str(op) for op in lane] == [
        "LOAD0", "F0.0", "F0.1", "STORE0", "LOAD1", "F1.0", "F1.1", "B1.0", "B1.1",
        "STORE1", "LOAD0", "B0.0", "B0.1", "STORE0"]
    assert [str(op) for op in schedules.serial_phased([0, 1], 1, False)] == [
        "LOAD0", "F0.0", "STORE0", "LOAD1", "F1.0", "STORE1"]
    lanes = schedules.parallel_phased(4, 1, True, [0, 1, 0, 1], 2)
    assert [str(op) for op in lanes[1]] == [
        "LOAD1", "F1.0", "STORE1", "LOAD3", "F3.0", "B3.0", "STORE3", "LOAD1", "B1.0",
        "STORE1"]
    assert all(op.lane == d for d, ops in enumerate(lanes) for op in ops)
    text = Timeline.of("serial phased", [lane], schedules.Topology.chain(2)).render()
    assert "LOAD1" in text and "STORE0" in text
    chain = schedules.Topology.chain(2)
    for bad, why in (([Action(F, 0, 0), Action(F, 1, 0), Action(STORE, 1)], "without"),
                     ([Action(LOAD, 0), Action(F, 0, 0), Action(STORE, 1)], "does not hold"),
                     ([Action(LOAD, 0), Action(LOAD, 0), Action(F, 0, 0)], "already holds"),
                     ([Action(LOAD, 0), Action(F, 0, 0)], "ends holding")):
        with pytest.raises(ValueError, match=why):
            schedules.check_dependencies([bad], schedules.Topology.chain(1)
                                         if all(op.stage == 0 for op in bad) else chain)


def test_the_dependency_check_refuses_bad_orders():
    chain = schedules.Topology.chain(2)
    backward_first = [[Action(B, 0, 0), Action(F, 0, 0)], [Action(F, 1, 0), Action(B, 1, 0)]]
    with pytest.raises(ValueError, match="wait for each other"):
        schedules.check_dependencies(backward_first, chain)
    twice = [[Action(F, 0, 0), Action(F, 0, 0)]]
    with pytest.raises(ValueError, match="twice"):
        schedules.check_dependencies(twice, schedules.Topology.chain(1))
    moved = [[Action(F, 0, 0), Action(B, 0, 0)],
             [Action(F, 1, 0), Action(IH, 1, 0)], [Action(W, 1, 0)]]
    with pytest.raises(ValueError, match="lane of its input half"):
        schedules.check_dependencies(moved, chain)


def test_new_schedules_shorten_the_laid_out_step():
    """Interleaving 4 stages on 2 devices and the zero-bubble split leave fewer idle
    slots than 1F1B (F: 1 slot, B: 2, I and W: 1 each)."""
    def bubble(name, placement):
        topo = schedules.Topology.chain(len(placement))
        lanes = schedules.pipeline_lanes(name, topo, placement, max(placement) + 1, 8, True)
        return Timeline.of(name, lanes, topo).bubble_fraction()

    assert bubble("Interleaved1F1B", [0, 1, 0, 1]) < bubble("1F1B", [0, 1, 0, 1])
    assert bubble("ZeroBubble", [0, 1, 2, 3]) < bubble("1F1B", [0, 1, 2, 3])
    # the zero-bubble weight halves fill the drain: stage 3 never idles once started
    topo = schedules.Topology.chain(4)
    lane = Timeline.of("zb", schedules.pipeline_lanes("ZeroBubble", topo, [0, 1, 2, 3], 4,
                                                      8, True), topo).cells()[3]
    assert all(a[0] + a[1] == b[0] for a, b in itertools.pairwise(lane))


def test_unknown_schedule_names_the_valid_ones():
    with pytest.raises(poptorch.Error, match="'1F1B', 'GPipe', 'Interleaved1F1B', "
                                             "'ZeroBubble'"):
        poptorch.PipelinedExecution().setSchedule("Bubbly")
    strategy = poptorch.PipelinedExecution().setSchedule("zerobubble")
    assert strategy.pipeline_schedule == "ZeroBubble"


# ------------------------------------------------------------------ training
class Chain(torch.nn.Module):
    def __init__(self, ipus):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(FEAT, FEAT) for _ in ipus)
        for k, (layer, ipu) in enumerate(zip(self.layers, ipus, strict=True)):
            poptorch.BeginBlock(layer, f"b{k}", ipu)

    def forward(self, x, y):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x, ((x - y)**2).mean()


def _phases(cls):
    return cls(poptorch.Phase(poptorch.Stage("b0")), poptorch.Phase(poptorch.Stage("b1")))


STRATEGIES = {
    "sharded": (lambda: poptorch.ShardedExecution(), [0, 1]),
    "1F1B": (lambda: poptorch.PipelinedExecution(), [0, 1]),
    "GPipe": (lambda: poptorch.PipelinedExecution().setSchedule("GPipe"), [0, 1]),
    "Interleaved1F1B": (lambda: poptorch.PipelinedExecution().setSchedule("Interleaved1F1B"),
                        [0, 1, 0, 1]),
    "ZeroBubble": (lambda: poptorch.PipelinedExecution().setSchedule("ZeroBubble"),
                   [0, 1]),
    "serial_phased": (lambda: _phases(poptorch.SerialPhasedExecution), [0, 0]),
    "parallel_phased": (lambda: _phases(poptorch.ParallelPhasedExecution), [0, 0]),
}
# (deviceIterations, gradientAccumulation, replicationFactor, backend): the compiled
# backend declines model parallelism (its stages run eagerly), so it is run once per
# strategy, checking that it falls back and gives the same results.
CASES = [(2, 8, 2, "eager"), (1, 8, 1, "inductor")]


@pytest.mark.parametrize("d,g,r,backend", CASES, ids=lambda v: str(v))
@pytest.mark.parametrize("name", list(STRATEGIES))
def test_training_matches_plain_pytorch(name, d, g, r, backend, monkeypatch):
    if backend == "inductor":
        monkeypatch.setenv("POPTORCH_BACKEND", "inductor")
        monkeypatch.setenv("POPTORCH_TORCH_COMPILE_BACKEND", "aot_eager")
    make, ipus = STRATEGIES[name]
    strategy = make()
    torch.manual_seed(0)
    model = Chain(ipus)
    reference = copy.deepcopy(model)
    poptorch.removeBlocks(reference)
    opts = poptorch.Options().deviceIterations(d).replicationFactor(r)
    opts.Training.gradientAccumulation(g)
    opts.outputMode(poptorch.OutputMode.All)
    opts.setExecutionStrategy(strategy)
    training = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.1))
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    per_step = g * r  # micro-batches summed into one optimizer step (mean reduction)
    for _ in range(3):
        x, y = torch.randn(d * per_step * MB, FEAT), torch.randn(d * per_step * MB, FEAT)
        out, _ = training(x, y)
        ref_outs = []
        for step in range(d):
            ref_opt.zero_grad()
            for k in range(per_step):
                sl = slice((step * per_step + k) * MB, (step * per_step + k + 1) * MB)
                ref_out, loss = reference(x[sl], y[sl])
                (loss / per_step).backward()
                ref_outs.append(ref_out.detach())
            ref_opt.step()
        torch.testing.assert_close(out, torch.cat(ref_outs), rtol=0, atol=1e-5)
    training.copyWeightsToHost()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert (p.detach() - q.detach()).abs().max() <= 1e-5
    record = training.schedule
    assert record is strategy.last_schedule and record.plan is not None
    lanes = record.plan.lanes
    schedules.check_dependencies(lanes, record.plan.topology)
    _covers(lanes, len(ipus), g, True)
    assert "bubble fraction" in str(training.schedule)
    assert training.backendInUse == "eager"
    if name in schedules.SCHEDULES:
        assert record.plan.name == name
