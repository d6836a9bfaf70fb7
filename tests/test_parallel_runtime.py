"""One in-process pipeline runtime (_runtime/placement/): the per-device engine runs
every call of a captured model, the first included; what it cannot run runs its stages
one after another in the calling thread, with one INFO line; the overlap markers are
checked on the captured graph before anything runs. Every model is compared with plain
PyTorch on the same data."""
import ast
import copy
import itertools
import logging
import pathlib

import pytest
import torch

import poptorch
from poptorch import _logging
from poptorch._runtime.config import RuntimeConfig
from poptorch._runtime.placement.build import build_runner
from poptorch._runtime.schedule.timeline import ENGINE, SEQUENTIAL

FEAT = 8
PLACEMENT = pathlib.Path(poptorch.__file__).parent / "_runtime" / "placement"


class Chain(torch.nn.Module):
    """Linear+tanh layers, one Block per layer (layer k on IPU ipus[k])."""

    def __init__(self, ipus, ids=None):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(FEAT, FEAT) for _ in ipus)
        self.ipus = ipus
        self.ids = ids or [f"b{k}" for k in range(len(ipus))]

    def forward(self, x, y):
        for layer, uid, ipu in zip(self.layers, self.ids, self.ipus, strict=True):
            with poptorch.Block(uid, ipu_id=ipu):
                x = torch.tanh(layer(x))
        return x, ((x - y)**2).mean()


class DataDependent(Chain):
    """Control flow on a tensor value: cannot be captured as a graph."""

    def forward(self, x, y):
        with poptorch.Block("b0", ipu_id=0):
            x = torch.tanh(self.layers[0](x))
            if x.sum() > 0:
                x = x * 2
        with poptorch.Block("b1", ipu_id=1):
            x = torch.tanh(self.layers[1](x))
        return x, ((x - y)**2).mean()


def _runner_of(model):
    runner = model._program.runner
    while not hasattr(runner, "partition") and hasattr(runner, "inner"):
        runner = runner.inner
    return runner


def _train_both(model, strategy, g, steps=3, mb=2, after_each=None):
    """Train a poptorch copy and a plain PyTorch copy on the same data, comparing the
    outputs of every call and the weights after every call."""
    reference = copy.deepcopy(model)
    opts = poptorch.Options()
    opts.Training.gradientAccumulation(g)
    opts.outputMode(poptorch.OutputMode.All)
    opts.setExecutionStrategy(strategy)
    training = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.1))
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    torch.manual_seed(0)
    for step in range(steps):
        x, y = torch.randn(g * mb, FEAT), torch.randn(g * mb, FEAT)
        out, _ = training(x, y)
        ref_opt.zero_grad()
        ref_outs = []
        for m in range(g):
            sl = slice(m * mb, (m + 1) * mb)
            ref_out, loss = reference(x[sl], y[sl])
            (loss / g).backward()
            ref_outs.append(ref_out.detach())
        ref_opt.step()
        torch.testing.assert_close(out, torch.cat(ref_outs), rtol=0, atol=1e-6)
        training.copyWeightsToHost()
        for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
            assert (p.detach() - q.detach()).abs().max() <= 1e-5, (step, name)
        if after_each is not None:
            after_each(step, training)
    return training


def test_the_first_call_of_a_pipeline_runs_on_the_engine():
    """2 IPUs, g=4, training: the first call (the compiling one) already runs the stage
    modules on the per-device engine, in 1F1B order, on both devices' workers."""
    strategy = poptorch.PipelinedExecution()
    schedules = []

    def first_call(step, training):
        record = strategy.last_schedule
        schedules.append(record)
        assert record.runtime == ENGINE
        assert {e.lane for e in record.events} == {0, 1}  # one worker per device
        # 1F1B: stage 0 warms up with one forward, stage 1 alternates at once
        assert record.stage_order(0) == [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1),
                                         ("F", 3), ("B", 2), ("B", 3)]
        assert record.stage_order(1) == [("F", 0), ("B", 0), ("F", 1), ("B", 1),
                                         ("F", 2), ("B", 2), ("F", 3), ("B", 3)]
        assert record.bubble_fraction() == pytest.approx(1 / 5)

    training = _train_both(Chain([0, 1]), strategy, 4, after_each=first_call)
    runner = _runner_of(training)
    assert sorted(runner.engine.workers) == [0, 1]
    assert len({id(r) for r in schedules}) == 3  # a new record each call


def test_an_uncapturable_pipeline_trains_like_pytorch_and_says_why_once(caplog, monkeypatch):
    monkeypatch.setattr(_logging, "_once_keys", set())
    caplog.set_level(logging.INFO, logger="poptorch::python")
    strategy = poptorch.PipelinedExecution()

    def sequential(step, training):
        record = strategy.last_schedule
        assert record.runtime == SEQUENTIAL
        for s in range(2):  # each micro-batch through both stages, then back
            assert record.stage_order(s) == [(k, m) for m in range(4) for k in "FB"]
        forwards = [e for e in record.events if e.kind == "F"]
        assert all(0 < e.start <= e.end for e in record.events)  # timed (profiler rows)
        assert all(a.end <= b.start for a, b in itertools.pairwise(forwards))

    training = _train_both(DataDependent([0, 1]), strategy, 4, after_each=sequential)
    assert _runner_of(training).engine is None
    lines = [r.getMessage() for r in caplog.records
             if "runs its stages one after another" in r.getMessage()]
    assert len(lines) == 1, lines
    assert "DataDependent" in lines[0] and "cannot be captured" in lines[0]


def test_a_sharded_stage_revisited_runs_sequentially_like_pytorch(caplog, monkeypatch):
    """Block "a" is entered again after "b": its stage reads a later stage's value,
    so the graph cannot be split into stage modules."""
    monkeypatch.setattr(_logging, "_once_keys", set())
    caplog.set_level(logging.INFO, logger="poptorch::python")
    strategy = poptorch.ShardedExecution()
    model = Chain([0, 1, 0], ids=["a", "b", "a"])

    def sequential(step, training):
        record = strategy.last_schedule
        assert record.runtime == SEQUENTIAL
        assert [(e.kind, e.stage) for e in record.events if e.microbatch == 0] == [
            ("F", 0), ("F", 1), ("F", 0), ("B", 0), ("B", 1), ("B", 0)]

    _train_both(model, strategy, 2, after_each=sequential)
    lines = [r.getMessage() for r in caplog.records
             if "runs its stages one after another" in r.getMessage()]
    assert len(lines) == 1 and "cannot be split apart" in lines[0], lines


def test_phases_of_two_stages_stream_one_phase_at_a_time_like_pytorch():
    strategy = poptorch.SerialPhasedExecution(
        poptorch.Phase(poptorch.Stage("b0"), poptorch.Stage("b1")),
        poptorch.Phase(poptorch.Stage("b2"), poptorch.Stage("b3")))
    strategy.setTensorsLiveness(poptorch.Liveness.OffChipAfterEachPhase)
    model = Chain([None] * 4)
    total = sum(p.numel() * p.element_size() for p in model.parameters())

    def sequential(step, training):
        assert strategy.last_schedule.runtime == SEQUENTIAL
        assert strategy.last_schedule.stage_order(1) == [("F", 0), ("B", 0),
                                                         ("F", 1), ("B", 1)]

    training = _train_both(model, strategy, 2, after_each=sequential)
    mem = _runner_of(training).streaming
    assert mem.peak_resident_bytes == total // 2  # one phase of two at a time
    # per micro-batch: phase 0, phase 1, then phase 0 again for its backward
    assert mem.loads == [0, 1, 0, 1, 0] * 3


class Scaled(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(FEAT, FEAT)
        self.b = torch.nn.Linear(FEAT, FEAT)

    def forward(self, x, y, scale=1.0):
        with poptorch.Block("a", ipu_id=0):
            h = torch.tanh(self.a(x)) * scale
        with poptorch.Block("b", ipu_id=1):
            out = self.b(h)
        return out, ((out - y)**2).mean()


def test_other_non_tensor_arguments_run_sequentially_like_pytorch():
    """The graph holds ``scale`` as captured; a call with another value runs the stages
    one after another through the model's forward (the engine again once they match)."""
    model = Scaled()
    reference = copy.deepcopy(model)
    opts = poptorch.Options()
    opts.Training.gradientAccumulation(4)
    torch.manual_seed(0)
    example = ((torch.randn(2, FEAT), torch.randn(2, FEAT)), {})
    runner = build_runner(model, RuntimeConfig.of(opts), True, example=example)
    assert runner.engine is not None
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for scale, runtime in [(1.0, ENGINE), (3.0, SEQUENTIAL), (1.0, ENGINE)]:
        mbs = [((torch.randn(2, FEAT), torch.randn(2, FEAT)), {"scale": scale})
               for _ in range(4)]
        opt.zero_grad()
        outs = runner(mbs, lambda out: out[1] / 4)
        opt.step()
        assert runner.last_schedule.runtime == runtime
        ref_opt.zero_grad()
        for (args, kwargs), got in zip(mbs, outs, strict=True):
            out, loss = reference(*args, **kwargs)
            (loss / 4).backward()
            torch.testing.assert_close(got[0], out, rtol=0, atol=1e-6)
        ref_opt.step()
        for p, q in zip(model.parameters(), reference.parameters(), strict=True):
            assert (p.detach() - q.detach()).abs().max() <= 1e-6


# ------------------------------------------------------------------ overlap markers
class Marked(torch.nn.Module):
    """Two stages; the input marked, used raw again when ``flags["bad"]``."""

    def __init__(self, mode):
        super().__init__()
        self.a = torch.nn.Linear(FEAT, FEAT)
        self.b = torch.nn.Linear(FEAT, FEAT)
        self.mode = mode
        self.flags = {"bad": True}

    def forward(self, x, y):
        with poptorch.Block("a", ipu_id=0):
            h = torch.tanh(self.a(poptorch.set_overlap_for_input(x, self.mode)))
            if self.flags["bad"]:
                h = h + x.mean()
        with poptorch.Block("b", ipu_id=1):
            out = self.b(h)
            loss = ((out - y)**2).mean()
        return poptorch.set_overlap_for_output(out, self.mode), loss


@pytest.mark.parametrize("name", ["pipelined", "sharded"])
def test_overlap_rules_on_the_captured_graph_raise_before_anything_runs(name):
    mode = poptorch.OverlapMode.NoOverlap if name == "pipelined" else \
        poptorch.OverlapMode.OverlapAccumulationLoop
    opts = poptorch.Options()
    opts.Training.gradientAccumulation(4)
    opts.outputMode(poptorch.OutputMode.All)
    if name == "sharded":
        opts.setExecutionStrategy(poptorch.ShardedExecution())
        opts.TensorLocations.numIOTiles(32)
    torch.manual_seed(0)
    model = Marked(mode)
    reference = copy.deepcopy(model)
    runs = []
    model.a.register_forward_hook(lambda *_: runs.append(1))  # a kernel of stage 0 ran
    before = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    pm = poptorch.trainingModel(model, opts, optimizer)
    x, y = torch.randn(8, FEAT), torch.randn(8, FEAT)
    with pytest.raises(poptorch.Error, match="This is not the case for input 0 to the "
                       r"model. Input 0 \('x'\) is also used by mean"):
        pm(x, y)
    assert not runs and not pm.isCompiled() and not optimizer.state_dict()["state"]
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    model.flags["bad"] = False  # fixed: the same wrapper compiles and trains
    reference.flags["bad"] = False
    out, _ = pm(x, y)
    assert runs and pm.options._execution_strategy.last_schedule.runtime == ENGINE
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    ref_outs = []
    for m in range(4):
        ref_out, loss = reference(x[2 * m:2 * m + 2], y[2 * m:2 * m + 2])
        (loss / 4).backward()
        ref_outs.append(ref_out.detach())
    ref_opt.step()
    torch.testing.assert_close(out, torch.cat(ref_outs), rtol=0, atol=1e-6)
    pm.copyWeightsToHost()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert (p.detach() - q.detach()).abs().max() <= 1e-6


def test_overlap_on_a_captured_pipeline_needs_the_options_of_overlapped_io():
    model = Marked(poptorch.OverlapMode.OverlapAccumulationLoop)
    model.flags["bad"] = False
    opts = poptorch.Options()
    opts.Training.gradientAccumulation(4)
    pm = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(poptorch.Error, match=r"not supported with poptorch\.PipelinedExecution"):
        pm(torch.randn(8, FEAT), torch.randn(8, FEAT))
    assert not pm.isCompiled()


# ------------------------------------------------------------------ annotations
def test_begin_block_is_a_hook_found_on_copies_and_removed_there():
    """BeginBlock is a forward pre-hook of the layer (no attribute written into the
    module): copies of the layer carry it, removeBlocks removes it from one copy only,
    and a deep copy of an annotated model is split as the original."""
    from poptorch._runtime.placement.markers import begin_block_of
    from poptorch._runtime.torch_internals import forward_pre_hooks

    layer = torch.nn.Linear(2, 2)
    before = dict(vars(layer))
    poptorch.BeginBlock(layer, "x", ipu_id=1)
    assert set(vars(layer)) == set(before)
    assert [type(h).__name__ for h in forward_pre_hooks(layer).values()] == ["BeginBlockHook"]
    copies = [copy.copy(layer), copy.deepcopy(layer)]
    assert all(begin_block_of(m).user_id == "x" for m in [layer, *copies])
    poptorch.removeBlocks(copies[1])
    assert begin_block_of(copies[1]) is None and not forward_pre_hooks(copies[1])
    assert begin_block_of(layer) is not None

    model = torch.nn.Sequential(torch.nn.Linear(FEAT, FEAT), torch.nn.Linear(FEAT, FEAT))
    poptorch.BeginBlock(model[0], "a", ipu_id=0)
    poptorch.BeginBlock(model[1], "b", ipu_id=1)
    opts = poptorch.Options()
    opts.Training.gradientAccumulation(4)
    example = ((torch.randn(2, FEAT), ), {})
    runner = build_runner(copy.deepcopy(model), RuntimeConfig.of(opts), True, example=example)
    assert [s.blocks for s in runner.partition.stages] == [["a"], ["b"]]


# ------------------------------------------------------------------ layout
def _thread_starts(source):
    """(enclosing class, line) of every ``Thread(...)`` / ``ThreadPoolExecutor(...)`` /
    ``Process(...)`` call in ``source``."""
    found = []

    def visit(node, cls):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                visit(child, child.name)
                continue
            if isinstance(child, ast.Call):
                func = child.func
                name = func.attr if isinstance(func, ast.Attribute) else \
                    func.id if isinstance(func, ast.Name) else None
                if name in ("Thread", "ThreadPoolExecutor", "Process"):
                    found.append((cls, child.lineno))
            visit(child, cls)

    visit(ast.parse(source), None)
    return found


def test_no_thread_per_microbatch_in_placement():
    """Only the engine starts threads: one long-lived worker per device
    (``engine.DeviceWorker``); nothing in placement starts one per micro-batch."""
    starts = {path.name: _thread_starts(path.read_text()) for path in PLACEMENT.glob("*.py")}
    assert [cls for cls, _ in starts.pop("engine.py")] == ["DeviceWorker"]
    assert {name: found for name, found in starts.items() if found} == {}


def test_the_thread_finder_sees_thread_starts():
    source = ("import threading\nclass A:\n    def f(self):\n"
              "        threading.Thread(target=1)\ndef g():\n    Thread()\n")
    assert _thread_starts(source) == [("A", 4), (None, 6)]
