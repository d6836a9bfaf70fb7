"""One profile per run: a valid Chrome/Perfetto trace with PopTorch's named ranges, the
user's tracepoints, stage rows, and a summary; results unchanged by profiling."""
import copy
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import poptorch
import poptorch.profiling
from poptorch._runtime import tracing


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(4, 8)
        self.fc2 = torch.nn.Linear(8, 3)

    def forward(self, x, y):
        with poptorch.NameScope("head"):
            h = torch.relu(self.fc1(x))
        out = self.fc2(h)
        return out, torch.nn.functional.cross_entropy(out, y)


class Staged(Net):
    def forward(self, x, y):
        with poptorch.Block(ipu_id=0):
            h = torch.relu(self.fc1(x))
        with poptorch.Block(ipu_id=1):
            out = self.fc2(h)
            loss = torch.nn.functional.cross_entropy(out, y)
        return out, loss


def ran_in_fresh_process(name):
    """Run test ``name`` in a new interpreter (True once it passed there): a whole-run
    profiler must not inherit the threads and profiler state that earlier tests of
    the suite left in this process. False inside that interpreter."""
    if os.environ.get("POPTORCH_TEST_CHILD") == "1":
        return False
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         f"{__file__}::{name}"], capture_output=True, text=True, timeout=600,
        env=dict(os.environ, POPTORCH_TEST_CHILD="1"))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "1 passed" in result.stdout
    return True


def data(rows, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 4, generator=g), torch.randint(0, 3, (rows,), generator=g)


def complete_events(path):
    with open(path, encoding="utf-8") as f:
        trace = json.load(f)  # valid JSON, as Perfetto / chrome://tracing read it
    events = trace["traceEvents"]
    for e in events:
        if e.get("ph") == "X":
            assert isinstance(e["ts"], (int, float)) and e["dur"] >= 0
    return [e for e in events if e.get("ph") == "X"]


def train(model, opts, batches):
    pop = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.1))
    return pop, [pop(x, y)[1] for x, y in batches]


def test_one_trace_per_run_with_named_ranges_and_summary(tmp_path, capsys):
    if ran_in_fresh_process("test_one_trace_per_run_with_named_ranges_and_summary"):
        return
    tracing.finish()
    torch.manual_seed(0)
    model = Net()
    twin = copy.deepcopy(model)
    opts = poptorch.Options().deviceIterations(2).replicationFactor(2)
    opts.Training.gradientAccumulation(2)
    plain_opts = opts.clone()
    opts.enableProfiling(str(tmp_path)).modelName("net")
    channel = poptorch.profiling.Channel("App")
    batches = [data(16, seed) for seed in range(3)]
    pop = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.1))
    losses = []
    pop(*batches[0])
    for x, y in batches:
        with channel.tracepoint("step"):
            losses.append(pop(x, y)[1])
    path = tracing.finish()
    _, ref_losses = train(twin, plain_opts, [batches[0]] + batches)
    for p, q in zip(model.parameters(), twin.parameters(), strict=False):
        assert torch.equal(p, q)  # profiling changes nothing
    assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses[1:], strict=False))

    assert os.listdir(tmp_path) == [os.path.basename(path)]  # one file for 4 calls
    names = [e["name"] for e in complete_events(path)]
    for call in range(4):
        assert f"poptorch::net.training call {call}" in names
    assert names.count("poptorch::device iteration 0") == 4
    assert names.count("poptorch::device iteration 1") == 4
    for k, replica in [(0, 0), (1, 1), (2, 0), (3, 1)]:
        assert names.count(f"poptorch::micro-batch {k} replica {replica}") == 8
    assert names.count("Optimizer.step#SGD.step") == 8
    assert names.count("App::step") == 3
    assert names.count("head") == 32  # the NameScope, once per micro-batch
    summary = capsys.readouterr().out
    assert path in summary
    assert "net.training: 4 calls, 8 device iterations" in summary
    assert "compute" in summary and "host" in summary
    assert "waiting for the host between calls (data loading, user code)" in summary
    assert "forward passes" in summary and "32 micro-batches" in summary


def test_pipeline_stages_get_their_own_rows_and_a_bubble(tmp_path, capsys):
    if ran_in_fresh_process("test_pipeline_stages_get_their_own_rows_and_a_bubble"):
        return
    tracing.finish()
    torch.manual_seed(0)
    model = Staged()
    twin = copy.deepcopy(model)
    opts = poptorch.Options()
    opts.Training.gradientAccumulation(4)
    opts.setExecutionStrategy(poptorch.PipelinedExecution(poptorch.AutoStage.AutoIncrement))
    plain_opts = opts.clone()
    opts.enableProfiling(str(tmp_path))
    batches = [data(8, seed) for seed in range(2)]
    _, losses = train(model, opts, batches)
    path = tracing.finish()
    _, ref_losses = train(twin, plain_opts, batches)
    assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses, strict=False))
    events = complete_events(path)
    stage_rows = {(e["name"], e["tid"]) for e in events if e["name"].startswith("stage ")}
    for m in range(4):
        for stage in (0, 1):
            for kind in ("forward", "backward"):
                assert (f"stage {stage} {kind} {m}", f"poptorch stage {stage}") in stage_rows
    call = next(e for e in events if e["name"] == "poptorch::Staged.training call 1")
    stage_ops = [e for e in events if e["name"].startswith("stage ")]
    # the stage rows sit on the same clock as torch's events, inside their call
    assert any(call["ts"] - 1e3 <= e["ts"] <= call["ts"] + call["dur"] + 1e3
               for e in stage_ops)
    summary = capsys.readouterr().out
    assert "time per stage: stage 0:" in summary and "stage 1:" in summary
    assert "pipeline bubble:" in summary


def test_profile_directory_from_poplar_and_pvti_variables(monkeypatch, tmp_path):
    opts = poptorch.Options()
    monkeypatch.delenv("POPLAR_ENGINE_OPTIONS", raising=False)
    monkeypatch.delenv("PVTI_OPTIONS", raising=False)
    assert tracing.profile_directory(opts) is None
    monkeypatch.setenv("POPLAR_ENGINE_OPTIONS",
                       json.dumps({"autoReport.all": "true", "autoReport.directory": "x"}))
    assert tracing.profile_directory(opts) == "x"
    monkeypatch.setenv("POPLAR_ENGINE_OPTIONS", '{"autoReport.all": "false"}')
    assert tracing.profile_directory(opts) is None
    monkeypatch.setenv("PVTI_OPTIONS", '{"enable": "true"}')
    assert tracing.profile_directory(opts) == "."
    assert tracing.profile_directory(poptorch.Options().enableProfiling("p")) == "p"
    monkeypatch.setenv("PVTI_OPTIONS", "{enable: true")
    with pytest.raises(poptorch.Error, match="PVTI_OPTIONS is not valid JSON"):
        tracing.profile_directory(opts)


def test_poplar_engine_options_give_one_trace_when_the_process_exits(tmp_path):
    code = textwrap.dedent("""
        import torch, poptorch
        model = torch.nn.Linear(4, 2)
        pop = poptorch.inferenceModel(model, poptorch.Options().deviceIterations(2))
        for _ in range(3):
            pop(torch.randn(4, 4))
    """)
    env = dict(os.environ, POPTORCH_LOG_LEVEL="WARN", POPLAR_ENGINE_OPTIONS=json.dumps(
        {"autoReport.all": "true", "autoReport.directory": str(tmp_path / "reports")}))
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    files = os.listdir(tmp_path / "reports")
    assert len(files) == 1 and files[0].endswith(".trace.json")
    names = [e["name"] for e in complete_events(tmp_path / "reports" / files[0])]
    assert [n for n in names if n.startswith("poptorch::Linear")] == [
        f"poptorch::Linear.inference call {i}" for i in range(3)]
    assert "Linear.inference: 3 calls, 6 device iterations" in result.stdout
