"""Execution strategies through the StepRunner contract, against plain PyTorch."""
import copy

import pytest
import torch

import poptorch
from poptorch._runtime.config import RuntimeConfig
from poptorch._runtime.placement.build import build_runner

FEAT = 6


class Chain(torch.nn.Module):
    """num_blocks linear layers; ``style`` picks the annotation style."""

    def __init__(self, num_blocks, style="block", ids=None):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(FEAT, FEAT) for _ in range(num_blocks))
        self.style = style
        self.ids = ids or [(None, i) for i in range(num_blocks)]
        if style == "begin":
            for layer, (uid, ipu) in zip(self.layers, self.ids, strict=False):
                poptorch.BeginBlock(layer, uid, ipu)

    def forward(self, x, y):
        for layer, (uid, ipu) in zip(self.layers, self.ids, strict=False):
            if self.style == "block":
                with poptorch.Block(uid, ipu):
                    x = torch.tanh(layer(x))
            elif self.style == "function":
                x = poptorch.BlockFunction(uid, ipu)(lambda v, l=layer: torch.tanh(l(v)))(x)
            else:
                x = torch.tanh(layer(x))
        return x, ((x - y)**2).mean()


def _options(g=1, d=1, strategy=None):
    opts = poptorch.Options()
    opts.deviceIterations(d)
    opts.Training.gradientAccumulation(g)
    if strategy is not None:
        opts.setExecutionStrategy(strategy)
    return opts


def _data(n):
    torch.manual_seed(1)
    return [((torch.randn(3, FEAT), torch.randn(3, FEAT)), {}) for _ in range(n)]


def _train_and_compare(model, opts, n, steps=3):
    reference = copy.deepcopy(model)
    poptorch.removeBlocks(reference)
    runner = build_runner(model, RuntimeConfig.of(opts), True)
    assert runner is not None
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for _step in range(steps):
        mbs = _data(n)
        opt.zero_grad()
        outs = runner(mbs, lambda out: out[1] / n)
        opt.step()
        ref_opt.zero_grad()
        ref_outs = []
        for (args, kwargs) in mbs:
            out = reference(*args, **kwargs)
            (out[1] / n).backward()
            ref_outs.append(out)
        ref_opt.step()
        for o, r in zip(outs, ref_outs, strict=False):
            assert torch.allclose(o[0], r[0], atol=1e-6)
    for p, q in zip(model.parameters(), reference.parameters(), strict=False):
        assert (p.detach() - q.detach()).abs().max() <= 1e-5
    return runner


def _strategies(num_ipus):
    ids = [str(i) for i in range(num_ipus)]
    serial = poptorch.SerialPhasedExecution(*[poptorch.Phase(poptorch.Stage(b)) for b in ids])
    parallel = poptorch.ParallelPhasedExecution(
        *[poptorch.Phase(poptorch.Stage(b)) for b in ids])
    return {
        "pipelined": poptorch.PipelinedExecution(),
        "sharded": poptorch.ShardedExecution(),
        "serial_phased": serial,
        "parallel_phased": parallel,
    }


@pytest.mark.parametrize("num_ipus", [2, 4])
@pytest.mark.parametrize("name", ["pipelined", "sharded", "serial_phased", "parallel_phased"])
def test_training_matches_pytorch(name, num_ipus):
    strategy = _strategies(num_ipus)[name]
    model = Chain(num_ipus, "block", [(str(i), i) for i in range(num_ipus)])
    n = 2 * num_ipus
    runner = _train_and_compare(model, _options(g=n, strategy=strategy), n)
    assert runner.partition.num_stages == num_ipus
    assert len(runner.last_schedule.events) == 2 * n * (num_ipus if "phased" not in name
                                                         else runner.partition.num_phases)


@pytest.mark.parametrize("num_ipus", [2, 4])
@pytest.mark.parametrize("name", ["pipelined", "sharded", "serial_phased", "parallel_phased"])
def test_inference_matches_pytorch(name, num_ipus):
    strategy = _strategies(num_ipus)[name]
    model = Chain(num_ipus, "block", [(str(i), i) for i in range(num_ipus)]).eval()
    reference = copy.deepcopy(model)
    runner = build_runner(model, RuntimeConfig.of(_options(d=num_ipus, strategy=strategy)),
                          False)
    mbs = _data(num_ipus)
    with torch.no_grad():
        outs = runner(mbs, None)
        for o, (args, kwargs) in zip(outs, mbs, strict=False):
            r = reference(*args, **kwargs)
            assert torch.equal(o[0], r[0]) and torch.equal(o[1], r[1])


@pytest.mark.parametrize("style", ["block", "begin", "function"])
def test_annotation_styles_same_partition(style):
    model = Chain(4, style, [(None, 0), (None, 1), (None, 2), (None, 3)])
    runner = _train_and_compare(model, _options(g=8), 8, steps=1)
    part = runner.partition
    assert [s.ipu for s in part.stages] == [0, 1, 2, 3]
    assert part.sequence == ["0", "1", "2", "3"]


def test_legacy_ipu_annotator():
    class Legacy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(FEAT, FEAT)
            self.b = poptorch.IPU(1, torch.nn.Linear(FEAT, FEAT))

        def forward(self, x, y):
            with poptorch.IPU(0):
                x = self.a(x)
            x = self.b(x)
            return x, ((x - y)**2).mean()

    runner = _train_and_compare(Legacy(), _options(g=4), 4, steps=1)
    assert [s.ipu for s in runner.partition.stages] == [0, 1]


def test_unannotated_model_has_no_runner():
    model = torch.nn.Linear(2, 2)
    assert build_runner(model, RuntimeConfig.of(_options()), True) is None


def test_fstring_ids_and_explicit_stages():
    ids = [(f"layer{i}", None) for i in range(4)]
    strategy = poptorch.PipelinedExecution(poptorch.Stage("layer0", "layer1"),
                                           poptorch.Stage("layer2", "layer3"))
    runner = _train_and_compare(Chain(4, "block", ids), _options(g=4, strategy=strategy), 4,
                                steps=1)
    assert [s.blocks for s in runner.partition.stages] == [["layer0", "layer1"],
                                                           ["layer2", "layer3"]]


def test_schedule_orders_gpipe_and_1f1b():
    def run(schedule):
        strategy = poptorch.PipelinedExecution().setSchedule(schedule)
        runner = _train_and_compare(Chain(4), _options(g=8, strategy=strategy), 8, steps=1)
        return runner.last_schedule

    gpipe = run("GPipe")
    for s in range(4):
        assert gpipe.stage_order(s) == [("F", m) for m in range(8)] + [("B", m) for m in range(8)]
    ofob = run("1F1B")
    for s in range(4):
        warm = 3 - s
        expected = [("F", m) for m in range(warm)]
        for i in range(8 - warm):
            expected += [("F", warm + i), ("B", i)]
        expected += [("B", m) for m in range(8 - warm, 8)]
        assert ofob.stage_order(s) == expected
    # 4 stages, 8 micro-batches: bubble (S-1)/(M+S-1)
    assert gpipe.bubble_fraction() == pytest.approx(3 / 11)
    assert ofob.bubble_fraction() == pytest.approx(3 / 11)
    assert "bubble fraction" in ofob.render()


def _rule_error(model, opts, training=True, n=4, match=""):
    runner = build_runner(model, RuntimeConfig.of(opts), training)
    with pytest.raises(poptorch.Error, match=match):
        runner(_data(n), (lambda out: out[1]) if training else None)


def test_rule_stage_ids_must_ascend():
    _rule_error(Chain(3, "block", [("a", 0), ("b", 1), ("c", 0)]), _options(g=8),
                match="Block 'c'.*must ascend")


def test_rule_auto_increment_allows_revisiting_ipu():
    strategy = poptorch.PipelinedExecution(poptorch.AutoStage.AutoIncrement)
    model = Chain(3, "block", [("a", 0), ("b", 1), ("c", 0)])
    runner = _train_and_compare(model, _options(g=8, strategy=strategy), 8, steps=1)
    assert [s.ipu for s in runner.partition.stages] == [0, 1, 0]


def test_rule_power_of_two():
    _rule_error(Chain(3), _options(g=8), match="power of 2")


def test_rule_gradient_accumulation_depth():
    _rule_error(Chain(2), _options(g=2), match="gradientAccumulation.*pipeline stages")


def test_rule_device_iterations_depth():
    _rule_error(Chain(2).eval(), _options(d=1), training=False, n=1,
                match="deviceIterations.*pipeline stages")


def test_rule_same_as_ipu_needs_ipu_id():
    _rule_error(Chain(2, "block", [("a", None), ("b", None)]), _options(g=4),
                match="Block 'a' has no ipu_id")


def test_rule_shared_weights_on_one_ipu():
    class Shared(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(FEAT, FEAT)

        def forward(self, x, y):
            with poptorch.Block("a", 0):
                x = self.lin(x)
            with poptorch.Block("b", 1):
                x = self.lin(x)
            return x, x.sum()

    _rule_error(Shared(), _options(g=4), match="lin.weight.*same IPU")


def test_rule_parallel_phases_even_odd():
    strategy = poptorch.ParallelPhasedExecution(poptorch.Phase(poptorch.Stage("0")),
                                                poptorch.Phase(poptorch.Stage("1")))
    strategy.phase(1).ipus(2)
    _rule_error(Chain(2, "block", [("0", None), ("1", None)]), _options(strategy=strategy),
                match="odd phases on odd IPUs")


def test_rule_block_not_in_stage_and_unknown_block():
    strategy = poptorch.PipelinedExecution(poptorch.Stage("0"))
    _rule_error(Chain(2, "block", [("0", None), ("1", None)]), _options(g=4, strategy=strategy),
                match="Block '1' is not in any Stage")
    strategy = poptorch.PipelinedExecution(poptorch.Stage("0"), poptorch.Stage("1", "zz"))
    _rule_error(Chain(2, "block", [("0", None), ("1", None)]), _options(g=4, strategy=strategy),
                match="'zz', which the model never entered")


def test_rule_begin_block_order():
    model = Chain(2, "plain")
    poptorch.BeginBlock(model.layers[1], ipu_id=1)
    poptorch.BeginBlock(model.layers[0], ipu_id=0)
    _rule_error(model, _options(g=4), match="BeginBlock order")


def test_rule_phase_ipus_count():
    with pytest.raises(poptorch.Error, match="2 stage"):
        poptorch.Phase(poptorch.Stage("a"), poptorch.Stage("b")).ipus(0)


def test_errors_in_workers_propagate():
    class Boom(Chain):
        def forward(self, x, y):
            out = super().forward(x, y)
            with poptorch.Block("1", 1):
                raise ValueError("boom in stage 1")
            return out

    runner = build_runner(Boom(2, "block", [("0", 0), ("1", 1)]), RuntimeConfig.of(_options(g=4)),
                          True)
    with pytest.raises(ValueError, match="boom"):
        runner(_data(4), lambda out: out[1])


def test_remove_blocks():
    model = Chain(2, "begin")
    poptorch.removeBlocks(model)
    assert all(not m._forward_pre_hooks for m in model.modules())


def test_phased_streaming_keeps_one_phase_resident():
    strategy = poptorch.SerialPhasedExecution(*[poptorch.Phase(poptorch.Stage(str(i)))
                                                for i in range(4)])
    strategy.setTensorsLiveness(poptorch.Liveness.OffChipAfterEachPhase)
    model = Chain(4, "block", [(str(i), None) for i in range(4)])
    runner = _train_and_compare(model, _options(g=2, strategy=strategy), 2, steps=2)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    mem = runner.streaming
    assert mem.peak_resident_bytes == total // 4  # one phase of four at a time
    assert mem.loads == [0, 1, 2, 3, 2, 1, 0] * 2  # phase 3 stays for its backward


def test_only_poptorch_block_words_mark_a_forward_as_annotated():
    """A user's ``ResBlock(...)`` is not ``poptorch.Block(...)``: the model runs as a
    plain model (no model-parallel runner); ``poptorch.Block`` inside ``forward`` is
    seen."""
    from poptorch._runtime.placement.build import _forward_uses_blocks

    class ResBlock(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(2, 2)

        def forward(self, x):
            return x + self.fc(x)

    class Plain(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.body = torch.nn.Sequential(ResBlock(), ResBlock())

        def forward(self, x):
            return self.body(x)

    class Annotated(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(2, 2)

        def forward(self, x):
            with poptorch.Block(ipu_id=0):
                return self.fc(x)

    assert not _forward_uses_blocks(Plain())
    assert _forward_uses_blocks(Annotated())
