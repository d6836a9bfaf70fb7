"""Replication across processes: tests that start ``torchrun --standalone
--nproc_per_node=2`` (gloo, one thread per process) on tests/distributed_worker.py and
compare what the processes saw with each other, with the same program run in this
process with the global replica count, and with a plain PyTorch loop.
"""
from __future__ import annotations

import os
import pathlib
import socket
import subprocess
import sys
import time

import pytest
import torch

import poptorch
from _distributed_cases import (CALLS, Branchy, branchy_batch, config_id, global_batch,
                                grouped_reference, make_model, pipeline_reference,
                                plain_reference,
                                poptorch_optimizer, process_rows, run_poptorch,
                                train_configs)

HERE = pathlib.Path(__file__).resolve().parent
WORKER = HERE / "distributed_worker.py"
TOL = 1e-6


def _env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", POPTORCH_DISTRIBUTED_TIMEOUT="30",
               PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    return env


def torchrun(scenario: str, out: pathlib.Path, *args: str, launcher: list | None = None,
             timeout: float = 120, env: dict | None = None) -> subprocess.CompletedProcess:
    launcher = launcher or ["--standalone", "--nproc_per_node=2"]
    cmd = [sys.executable, "-m", "torch.distributed.run", *launcher, str(WORKER), scenario,
           str(out), *args]
    return subprocess.run(cmd, cwd=HERE, env={**_env(), **(env or {})},
                          capture_output=True, text=True, timeout=timeout)


def _check(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


def _load(out: pathlib.Path, name: str) -> list:
    return [torch.load(out / f"{name}_rank{rank}.pt", weights_only=False) for rank in (0, 1)]


def _assert_close(actual: dict, expected: dict, what: str) -> None:
    for key in expected:
        diff = (actual[key] - expected[key]).abs().max().item()
        assert diff <= TOL, f"{what}: {key} differs by {diff}"


def _assert_identical(a, b, what: str) -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys(), what
        for key in a:
            _assert_identical(a[key], b[key], f"{what}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), what
        for i, (x, y) in enumerate(zip(a, b, strict=False)):
            _assert_identical(x, y, f"{what}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), f"{what} differs between processes"
    else:
        assert a == b, f"{what}: {a!r} != {b!r}"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("train")
    result = torchrun("train", out)
    _check(result)
    # nothing to distract a user: no warnings from DDP or from us on a healthy run
    assert "Warning" not in result.stderr, result.stderr[-3000:]
    return out


@pytest.mark.parametrize("cfg", train_configs(), ids=config_id)
def test_training_matches_one_process_and_plain_pytorch(trained, cfg):
    rank0, rank1 = _load(trained, config_id(cfg))
    # bitwise the same weights and optimizer state on both processes
    _assert_identical(rank0["state"], rank1["state"], "weights")
    _assert_identical(rank0["optimizer"]["state"], rank1["optimizer"]["state"],
                      "optimizer state")
    # the same program in one process with the global replica count (2r); both runs
    # start from process 0's initial weights
    single = make_model(1000)
    run_poptorch(single, {**cfg, "r": 2 * cfg["r"]}, rank=0)
    _assert_close(rank0["state"], single.state_dict(), "one process, global replicas")
    # a plain PyTorch loop over every replica's micro-batches
    plain = make_model(1000)
    plain_reference(plain, cfg, replicas=2 * cfg["r"])
    _assert_close(rank0["state"], plain.state_dict(), "plain PyTorch")
    # each process's losses are its own replicas' (not the same numbers)
    assert not torch.equal(rank0["losses"][-1], rank1["losses"][-1])


COMPILED_CALLS = 48  # enough for the fastest backend's trial to decide (up to 3 rounds)


def _compiled_run(tmp_path, backend: str, reduction: str = "Mean", optimizer: str = "SGD",
                  *args: str):
    """The "compiled" scenario with ``backend``: the compiled pieces captured without
    code generation (aot_eager: the same graphs, eager kernels)."""
    result = torchrun("compiled", tmp_path, str(COMPILED_CALLS), reduction, optimizer, *args,
                      env={"POPTORCH_BACKEND": backend, "POPTORCH_LOG_LEVEL": "INFO",
                           "POPTORCH_TORCH_COMPILE_BACKEND": "aot_eager"})
    _check(result)
    rank0, rank1 = _load(tmp_path, "compiled")
    _assert_identical(rank0["state"], rank1["state"], "weights")
    plain = make_model(1000)
    plain_reference(plain, {"r": 1, "reduction": reduction, "optimizer": optimizer},
                    replicas=2, calls=COMPILED_CALLS)
    _assert_close(rank0["state"], plain.state_dict(), "plain PyTorch")
    return rank0, rank1, result.stdout + result.stderr


@pytest.mark.parametrize("backend,reduction,optimizer", [
    ("inductor", "Mean", "SGD"), ("inductor", "Sum", "Adam"), ("fastest", "Mean", "SGD")])
def test_compiled_training_over_two_processes_matches_plain_pytorch(
        tmp_path, backend, reduction, optimizer):
    rank0, rank1, log = _compiled_run(tmp_path, backend, reduction, optimizer)
    assert log.count("compiled backend: the first micro-batch compiled") == 2, log[-3000:]
    assert rank0["compiled_kept"] == rank1["compiled_kept"]
    if backend == "inductor":  # kept for good; the reducer, not DDP, sums gradients
        assert rank0["compiled_kept"] and not rank0["ddp_reduces"]
        assert rank0["backend"] == rank1["backend"] == "compiled"
    else:  # one decision, on the mean of both processes' ratios, taken by both
        decisions = [line for line in log.splitlines() if "the mean over 2 processes" in line]
        assert len(decisions) == 2, log[-3000:]
        kept = "keeping the compiled backend" in decisions[0]
        assert kept == ("keeping the compiled backend" in decisions[1])
        assert rank0["compiled_kept"] == kept and rank0["ddp_reduces"] == (not kept)


def test_a_compile_failing_on_one_process_moves_both_to_the_eager_backend(tmp_path):
    """Process 1's code generation fails: its step is undone and run again eagerly
    (one WARNING), process 0 hears of it with that step's gradients, and both leave
    the compiled backend together; the weights stay identical and plain PyTorch's."""
    rank0, rank1, log = _compiled_run(tmp_path, "inductor", "Mean", "SGD", "1")
    assert log.count("compiled backend failed (code generation") == 1, log[-3000:]
    assert "injected code generation failure on process 1" in log
    assert "the compiled backend failed on another process" in log, log[-3000:]
    for rank in (rank0, rank1):  # both left together, and DDP took the reduction over
        assert not rank["compiled_kept"] and rank["ddp_reduces"]
        assert rank["backend"] == "eager"


def test_parameters_unused_in_the_last_micro_batch_are_reduced(tmp_path):
    _check(torchrun("dynamic", tmp_path))
    rank0, rank1 = _load(tmp_path, "dynamic")
    _assert_identical(rank0, rank1, "weights")
    torch.manual_seed(1000)
    plain = Branchy()
    optimizer = torch.optim.SGD(plain.parameters(), lr=0.1)
    plain_reference(plain, {"reduction": "Mean"}, replicas=2, optimizer=optimizer,
                    batches=branchy_batch)
    _assert_close(rank0, plain.state_dict(), "plain PyTorch")


def test_a_process_group_the_program_made_is_reused(tmp_path):
    _check(torchrun("user_group", tmp_path))
    rank0, rank1 = _load(tmp_path, "user_group")
    _assert_identical(rank0["state"], rank1["state"], "weights")
    plain = make_model(1000)
    plain_reference(plain, {"reduction": "Mean", "optimizer": "SGD"}, replicas=2)
    _assert_close(rank0["state"], plain.state_dict(), "plain PyTorch")
    assert rank0["total"].item() == rank1["total"].item() == 3.0


def test_a_parameter_unused_after_the_first_step_is_an_error_not_a_bad_update(tmp_path):
    """DDP runs without searching for unused parameters when the first step used them
    all; a later step that leaves one out raises on every process before its update.
    POPTORCH_DISTRIBUTED_FIND_UNUSED=1 makes DDP search, and the same run trains."""
    _check(torchrun("unused_later", tmp_path))
    rank0, rank1 = _load(tmp_path, "unused_later")
    for rank in (rank0, rank1):
        assert "POPTORCH_DISTRIBUTED_FIND_UNUSED=1" in rank[False]["error"], rank[False]
        _assert_identical(rank[False]["after_second"], rank[False]["after_first"],
                          "weights after the refused step")
        assert rank[True]["error"] == "no error", rank[True]["error"]
        assert not torch.equal(rank[True]["after_second"]["a.weight"],
                               rank[True]["after_first"]["a.weight"])
    _assert_identical(rank0[True]["after_second"], rank1[True]["after_second"], "weights")


def test_replica_grouped_weights_over_two_processes(tmp_path):
    """2 processes x 2 replicas; groups of 2 replicas (Consecutive: the processes;
    Orthogonal: across the processes)."""
    _check(torchrun("groups", tmp_path))
    for kind in ("Consecutive", "Orthogonal"):
        rank0, rank1 = _load(tmp_path, f"groups_{kind}")
        _assert_identical(rank0, rank1, f"{kind} grouped weight")
        expected = grouped_reference(kind, replicas=4, size=2)
        diff = (rank0 - expected).abs().max().item()
        assert diff <= TOL, f"{kind}: grouped weight differs from plain PyTorch by {diff}"
    rank0, rank1 = _load(tmp_path, "groups_AllReplicas")
    _assert_identical(rank0, rank1, "AllReplicas grouped weight")
    expected = grouped_reference("Orthogonal", replicas=4, size=2)[torch.tensor([0, 1, 0, 1])]
    diff = (rank0 - expected).abs().max().item()
    assert diff <= TOL, f"AllReplicas: every replica's slice differs by {diff}"


@pytest.fixture(scope="module")
def strategies_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("strategies")
    _check(torchrun("strategies", out))
    return out


@pytest.mark.parametrize("strategy", ["pipelined", "sharded", "serial_phased",
                                      "parallel_phased"])
def test_model_parallel_replicas_over_two_processes(strategies_run, strategy):
    """Each process holds a whole 2-IPU model; gradients summed over both."""
    rank0, rank1 = _load(strategies_run, strategy)
    _assert_identical(rank0, rank1, "weights")
    plain = make_model(1000)
    pipeline_reference(plain, replicas=2)
    _assert_close(rank0, plain.state_dict(), "plain PyTorch")
    assert not torch.equal(rank0["fc1.weight"], make_model(1000).fc1.weight), "no training"


def test_buffers_follow_broadcast_buffers(tmp_path):
    _check(torchrun("buffers", tmp_path))
    for broadcast in (True, False):
        rank0, rank1 = _load(tmp_path, f"buffers_{broadcast}")
        # one process with 2 replicas: the host sees replica 0's buffers
        single = make_model(1000, batchnorm=True)
        opts = poptorch.Options().deviceIterations(2).replicationFactor(2)
        opts.Training.gradientAccumulation(2)
        opts.broadcastBuffers(broadcast)
        training = poptorch.trainingModel(
            single, opts, poptorch.optim.SGD(single.parameters(), lr=0.1, momentum=0.9))
        for call in range(CALLS):
            training(*process_rows(global_batch(call, 2), 0, 2))
        _assert_close(rank0, single.state_dict(), f"broadcastBuffers({broadcast})")
        weights = [k for k in rank0 if "running" not in k and "num_batches" not in k]
        _assert_identical({k: rank0[k] for k in weights}, {k: rank1[k] for k in weights},
                          "weights")
        same = torch.equal(rank0["norm.running_mean"], rank1["norm.running_mean"])
        assert same == broadcast, f"broadcastBuffers({broadcast}): running_mean same={same}"


def test_checkpoint_from_two_processes_resumes_in_one(tmp_path):
    _check(torchrun("checkpoint", tmp_path))
    continued = _load(tmp_path, "continued")
    _assert_identical(continued[0], continued[1], "weights")
    saved = torch.load(tmp_path / "checkpoint.pt", weights_only=False)
    model = make_model(0)
    model.load_state_dict(saved["model"])
    optimizer = poptorch_optimizer("Adam", model.parameters())
    optimizer.load_state_dict(saved["optimizer"])
    cfg = {"r": 2, "reduction": "Mean", "optimizer": "Adam"}
    run_poptorch(model, cfg, rank=0, first_call=CALLS, optimizer=optimizer)
    _assert_close(continued[0], model.state_dict(), "resumed at world size 1")
    # and the uninterrupted run in plain PyTorch (from process 0's initial weights)
    plain = make_model(1000)
    plain_reference(plain, cfg, replicas=2, calls=2 * CALLS)
    _assert_close(continued[0], plain.state_dict(), "plain PyTorch, uninterrupted")
    # process 0 evaluated alone (no hang): its outputs are the trained model's
    inference = torch.load(tmp_path / "inference_rank0.pt", weights_only=False)
    evaluated = make_model(0)
    evaluated.load_state_dict(continued[0])
    with torch.no_grad():
        expected, _ = evaluated(inference["x"], inference["y"])
    torch.testing.assert_close(inference["output"], expected, atol=1e-6, rtol=0)


def test_one_epoch_reads_every_item_once_across_processes(tmp_path):
    _check(torchrun("epoch", tmp_path))
    rank0, rank1 = _load(tmp_path, "epoch")
    combined = 3 * 2  # batch_size x deviceIterations
    for drop_last in (True, False):
        a = [i for batch in rank0[drop_last] for i in batch]
        b = [i for batch in rank1[drop_last] for i in batch]
        assert len(rank0[drop_last]) == len(rank1[drop_last])  # same number of calls
        if drop_last:   # disjoint shares of 51 items, each read as 8 combined batches
            assert not set(a) & set(b)
            assert len(a) == len(b) == 103 // 2 // combined * combined
        else:   # shares of 52: every item read, the one left over wraps round (docs/data.md)
            assert sorted(set(a + b)) == list(range(103))
            assert len(a) == len(b) == 52
    # inference: each process computed its own share, as the plain model does
    torch.manual_seed(5)
    plain = torch.nn.Linear(1, 2)
    shares = []
    for seen in (rank0, rank1):
        assert seen["inference"], "no inference batches"
        items = []
        for batch, output in seen["inference"]:
            with torch.no_grad():
                torch.testing.assert_close(output, plain(batch), atol=1e-6, rtol=0)
            items += batch.reshape(-1).long().tolist()
        shares.append(items)
    assert not set(shares[0]) & set(shares[1])
    assert len(shares[0]) == len(shares[1]) == 103 // 2 // combined * combined


def test_mismatched_options_raise_on_every_process(tmp_path):
    start = time.monotonic()
    result = torchrun("mismatch", tmp_path, timeout=60)
    assert time.monotonic() - start < 60
    assert result.returncode != 0
    expected = {"deviceIterations": (2, 3), "replicationFactor": (1, 2),
                "Training.gradientAccumulation": (2, 3),
                "setExecutionStrategy": ("'ShardedExecution'", "'PipelinedExecution'")}
    for messages in _load(tmp_path, "mismatch"):
        assert set(messages) == set(expected)
        for name, (value0, value1) in expected.items():
            message = messages[name]
            assert f"{name}: process 0 has {value0}, process 1 has {value1}" in message, \
                message


def test_a_killed_process_ends_the_run_with_an_error(tmp_path):
    start = time.monotonic()
    result = torchrun("kill", tmp_path, timeout=90)
    elapsed = time.monotonic() - start
    assert result.returncode != 0
    assert elapsed < 60, f"the run took {elapsed:.0f} s to end after a process died"
    assert "SIGKILL" in result.stderr or "Signal 9" in result.stderr, result.stderr[-2000:]
    assert not (tmp_path / "finished_rank0.txt").exists()


@pytest.mark.parametrize("how", ["kill", "stall"])
def test_without_torchrun_a_lost_process_is_a_poptorch_error_on_the_others(tmp_path, how):
    """With a launcher that does not stop the survivors (here: none), process 0 gets a
    poptorch.Error: at once when process 1 dies, after POPTORCH_DISTRIBUTED_TIMEOUT
    seconds when it stops taking part."""
    env = dict(_env(), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
               POPTORCH_DISTRIBUTED_TIMEOUT="5")
    procs = [subprocess.Popen([sys.executable, str(WORKER), "fault", str(tmp_path), how],
                              cwd=HERE, env=dict(env, RANK=str(rank)),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for rank in (0, 1)]
    outputs = [proc.communicate(timeout=120)[0] for proc in procs]
    assert procs[0].returncode == 3, outputs[0][-3000:]
    message = (tmp_path / "error_rank0.txt").read_text()
    assert message.startswith("poptorch.errors.RecoverableError"), message  # errors.md
    assert "recovery_action=PARTITION_RESET" in message, message
    assert "another process of this run has probably stopped" in message, message
    seconds = float(message.split(" after ")[1].split("s:")[0])
    assert seconds < 60, message
    if how == "stall":
        assert seconds >= 4, f"gave up before the 5 s timeout: {message}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_with_c10d_rendezvous(tmp_path):
    """torchrun --nnodes=2 --rdzv-backend=c10d, as two "nodes" on this machine."""
    cfg = train_configs()[0]
    endpoint = f"127.0.0.1:{_free_port()}"
    launcher = ["--nnodes=2", "--nproc_per_node=1", "--rdzv-backend=c10d",
                f"--rdzv-endpoint={endpoint}", "--rdzv-id=poptorch-test"]
    cmd = [sys.executable, "-m", "torch.distributed.run", *launcher, str(WORKER), "train",
           str(tmp_path), config_id(cfg)]
    nodes = [subprocess.Popen(cmd, cwd=HERE, env=_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    for node in nodes:
        output, _ = node.communicate(timeout=120)
        assert node.returncode == 0, output[-3000:]
    rank0, rank1 = _load(tmp_path, config_id(cfg))
    _assert_identical(rank0["state"], rank1["state"], "weights")
    plain = make_model(1000)
    plain_reference(plain, cfg, replicas=2 * cfg["r"])
    _assert_close(rank0["state"], plain.state_dict(), "plain PyTorch")


def test_the_digits_example_runs_unchanged_under_torchrun(tmp_path):
    """README's "Scaling out" command: examples/train_digits.py as is on two processes
    (each trains on its share; process 0 alone reports the global test accuracy)."""
    example = HERE.parent / "examples" / "train_digits.py"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc_per_node=2", str(example), "--epochs", "3", "--target", "0.85"]
    result = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True,
                            timeout=120)
    _check(result)
    reports = [line for line in result.stdout.splitlines() if line.startswith("digits:")]
    assert len(reports) == 1 and "reached" in reports[0], result.stdout[-2000:]
