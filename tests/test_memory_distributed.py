"""Replicated tensor sharding of the optimizer state across processes: torchrun
``--nproc_per_node=2`` (gloo, one thread each) on tests/memory_worker.py, compared with
the unsharded run, a plain PyTorch loop, and a resumption at world size 1; weights and
accumulators sharded too (tests/fsdp_worker.py), their checkpoints resumed at 1 process
and, sharded, at 4 (``--nproc_per_node=4``) bit for bit.
"""
from __future__ import annotations

import gc
import os
import pathlib
import subprocess
import sys
import weakref

import pytest
import torch

import poptorch
from poptorch.enums import CommGroupType
from _memory_cases import (CALLS, G, KINDS, Exact, Grouped, adamw, exact_batch,
                           exact_options, exact_reference, exact_sgd, global_batch,
                           grouped_batch, location_options, make_model, options,
                           plain_reference, train, train_grouped, M)

HERE = pathlib.Path(__file__).resolve().parent
TOL = 1e-6


def _torchrun(worker: str, out: pathlib.Path, processes: int = 2, *args: str,
              timeout: int = 240) -> None:
    """``torchrun --nproc_per_node=processes tests/<worker> out args`` (gloo, one
    thread per process); fails the test with the end of its output."""
    env = dict(os.environ, OMP_NUM_THREADS="1", POPTORCH_DISTRIBUTED_TIMEOUT="60",
               PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone",
         f"--nproc_per_node={processes}", str(HERE / worker), str(out), *args],
        cwd=HERE, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("memory")
    _torchrun("memory_worker.py", out)

    def load(name: str) -> list:
        return [torch.load(out / f"{name}_rank{rank}.pt", weights_only=False)
                for rank in (0, 1)]
    return load


def _max_diff(a: dict, b: dict) -> float:
    return max((a[k].float() - b[k].float()).abs().max().item() for k in b)


def _state_diff(a: dict, b: dict) -> float:
    assert a["state"].keys() == b["state"].keys()
    worst = 0.0
    for i in b["state"]:
        assert a["state"][i].keys() == b["state"][i].keys()
        for key, value in b["state"][i].items():
            assert a["state"][i][key].shape == value.shape
            assert a["state"][i][key].dtype == value.dtype
            worst = max(worst, (a["state"][i][key].float() - value.float()).abs().max().item())
    return worst


def test_sharded_weights_equal_unsharded_and_plain_pytorch(runs):
    sharded, unsharded = runs("adamw_sharded1"), runs("adamw_sharded0")
    buckets = runs("adamw_sharded2")  # fc1.weight and fc2.weight in buckets of their own
    streamed = runs("adamw_sharded3")  # state moved to and from host memory (forced)
    reference = plain_reference(make_model(1000), range(CALLS), 2)
    for rank in (0, 1):
        assert _max_diff(sharded[rank]["weights"], unsharded[rank]["weights"]) <= TOL
        assert _max_diff(sharded[rank]["weights"], reference) <= TOL
        assert _max_diff(buckets[rank]["weights"], reference) <= TOL
        assert _max_diff(streamed[rank]["weights"], reference) <= TOL
    # the gathered state dict is PopTorch's whole one, the same on both processes
    for rank in (0, 1):
        assert _state_diff(sharded[rank]["state_dict"], unsharded[0]["state_dict"]) <= TOL
        assert sharded[rank]["state_dict"]["poptorch"] == unsharded[0]["state_dict"]["poptorch"]


def test_each_process_holds_half_of_the_state(runs):
    sharded, unsharded = runs("adamw_sharded1"), runs("adamw_sharded0")
    full = unsharded[0]["bytes"]
    assert unsharded[1]["bytes"] == full
    # fc1.weight (40) and fc2.weight (24) are split, the biases (8, 3) are whole on both
    whole = 2 * 4 * (8 + 3)  # exp_avg and exp_avg_sq, float32
    split = full - whole
    assert [s["bytes"] - whole for s in sharded] == [split // 2, split // 2]
    assert max(s["bytes"] for s in sharded) <= 0.55 * full + whole


def test_sharded_checkpoint_resumes_at_world_size_one(runs):
    """Written at world size 2 (sharded), resumed in one process with the same two
    replicas (sharded over them, and unsharded): equals the uninterrupted run."""
    uninterrupted = runs("adamw_sharded1")[0]["weights"]
    checkpoint = runs("adamw_sharded1")[0]["checkpoint"]
    for sharded in (True, False):
        model = make_model(5)
        model.load_state_dict(checkpoint["model"])
        optimizer = adamw(model)
        optimizer.load_state_dict(checkpoint["optimizer"])
        train(model, options(2, sharded), optimizer, range(CALLS // 2, CALLS), 2)
        assert _max_diff(model.state_dict(), uninterrupted) <= TOL


def _grouped_plain() -> torch.Tensor:
    """Orthogonal groups of 2 over 4 replicas: replica k uses slice k % 2; the loss is
    the mean of the replicas' losses."""
    w = torch.nn.Parameter(Grouped(2).W.detach().clone())
    optimizer = torch.optim.Adam([w], lr=0.05)
    for call in range(CALLS):
        x = grouped_batch(call, 4)
        optimizer.zero_grad()
        losses = [((x[k * M:(k + 1) * M] @ w[k % 2]) ** 2).mean() for k in range(4)]
        (sum(losses) / 4).backward()
        optimizer.step()
    return w.detach()


def test_replica_groups_shard_each_group_over_its_replicas(runs):
    sharded, unsharded = runs("grouped_sharded1"), runs("grouped_sharded0")
    plain = _grouped_plain()
    model = Grouped(2)
    train_grouped(model, 4, False, CommGroupType.Orthogonal, 2)
    for rank in (0, 1):
        assert _max_diff(sharded[rank]["weights"], unsharded[rank]["weights"]) <= TOL
        assert (sharded[rank]["weights"]["W"] - plain).abs().max().item() <= TOL
        assert (sharded[rank]["weights"]["W"] - model.W.detach()).abs().max().item() <= TOL
        assert _state_diff(sharded[rank]["state_dict"], unsharded[0]["state_dict"]) <= TOL


# --- weights / accumulators sharded over the processes (FSDP2: memory/fsdp.py) --------
@pytest.fixture(scope="module")
def fsdp_out(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp")
    _torchrun("fsdp_worker.py", out, timeout=300)
    return out


def _loader(out: pathlib.Path, processes: int = 2):
    def load(name: str) -> list:
        return [torch.load(out / f"{name}_rank{rank}.pt", weights_only=False)
                for rank in range(processes)]
    return load


@pytest.fixture(scope="module")
def fsdp_runs(fsdp_out):
    return _loader(fsdp_out)


@pytest.mark.parametrize("name", [f"{k}_{m}" for k in KINDS
                                  for m in ("rts", "offchip", "both")]
                         + [f"{k}_both_compiled" for k in KINDS]
                         + ["all_rts", "all_rts_offchip", "all_rts_offchip_compiled"])
def test_sharded_weights_train_as_plain_pytorch(fsdp_runs, name):
    """{weights, accumulators, optimizer} x {RTS, off chip, both}, 2 micro-batches per
    step, clipping and loss scaling: the same weights as the unsharded run and a plain
    PyTorch loop over the global batches (1e-6), whole in state_dict() on every
    process; weights or accumulators with RTS hold DTensor shards. Asked for the
    compiled backend, sharded weights keep the eager call path (FSDP2's hooks wrap
    every call) and each block's forward is compiled on its own, the gathers between
    them; a sharded optimizer state alone runs the compiled micro-batches. The worker
    compiles with aot_eager (inductor's graphs, eager kernels): within 1e-6 too."""
    runs, unsharded = fsdp_runs(name), fsdp_runs("plain")
    reference = plain_reference(make_model(1000), range(CALLS), 2 * G)
    for rank in (0, 1):
        assert _max_diff(runs[rank]["weights"], reference) <= TOL
        assert _max_diff(runs[rank]["weights"], unsharded[rank]["weights"]) <= TOL
        assert _state_diff(runs[rank]["state_dict"], unsharded[0]["state_dict"]) <= TOL
        rts_weights = ("rts" in name or "both" in name) and not name.startswith("optimizer")
        compiled = name.endswith("compiled")
        if rts_weights:
            assert runs[rank]["backend"] == "eager"
        elif compiled:  # (the optimizer's state alone: the compiled micro-batches)
            assert runs[rank]["backend"] == "compiled"
        assert runs[rank]["compiled_units"] == (compiled and rts_weights)
        assert runs[rank]["sharded"] == (["fc1.weight", "fc2.weight"] if rts_weights else [])


def test_sharded_weights_checkpoint_resumes_unsharded_at_world_size_one(fsdp_runs):
    """Taken with all three sharded at 2 processes (whole tensors gathered), resumed
    in one process without sharding (the same global batches in 2 x G micro-batches):
    the uninterrupted sharded run's weights, within 1e-6 (the reductions add in
    another order across world sizes, so not bitwise)."""
    sharded = fsdp_runs("all_rts")
    checkpoint = sharded[0]["checkpoint"]
    assert _max_diff(sharded[1]["checkpoint"]["model"], checkpoint["model"]) == 0.0
    model = make_model(5)
    model.load_state_dict(checkpoint["model"])
    optimizer = adamw(model)
    optimizer.load_state_dict(checkpoint["optimizer"])
    training = poptorch.trainingModel(model, location_options((), False, False, 2 * G),
                                      optimizer)
    for call in range(CALLS // 2, CALLS):
        training(*global_batch(call, 2 * G))
    assert _max_diff(model.state_dict(), sharded[0]["weights"]) <= TOL


def test_at_most_two_blocks_of_whole_weights_at_once(fsdp_runs):
    """8 blocks, weights RTS: the runtime's accounting (gathered units plus the one
    prefetched) and the test's own hooks on the blocks (blocks whose parameters are
    whole tensors at each block's forward and backward) see at most 2 blocks whole."""
    for run in fsdp_runs("peak"):
        block = 16 * 16 * 4 + 16 * 4
        assert run["unit_bytes"] == [block] * 8
        assert run["shard_bytes"] == 8 * block // 2
        assert run["seen"] and max(run["seen"]) <= 2
        assert run["peak_units"] <= 2
        assert run["shard_bytes"] < run["peak_bytes"] <= run["shard_bytes"] + 2 * block


def test_a_dropped_sharded_program_frees_its_optimizer_and_model(fsdp_runs):
    """All three RTS: once the program is destroyed and dropped, the optimizer and the
    model (and so every weight and state shard) are freed, as after a plain PyTorch
    loop."""
    model = make_model(0)
    optimizer = torch.optim.AdamW(model.parameters())
    model(*global_batch(0, 1))[1].backward()
    optimizer.step()
    refs = [weakref.ref(optimizer), weakref.ref(model)]
    del optimizer, model
    gc.collect()
    plain = [ref() is not None for ref in refs]
    assert plain == [False, False]
    for run in fsdp_runs("freed"):
        assert run["alive"] == plain


def test_planned_memory_actions_keep_two_blocks():
    """The plan of a step (as schedule actions): each block gathered before its forward
    and backward, dropped after, reduce-scattered after the backward that reduces."""
    from poptorch._runtime.memory.fsdp import peak_gathered, planned_actions
    from poptorch._runtime.schedule.actions import ActionKind
    plan = planned_actions(8, 2, reshard_after_forward=True, sync_every_microbatch=False)
    assert peak_gathered(plan) == 2
    scatters = [a for a in plan if a.kind == ActionKind.REDUCE_SCATTER]
    assert [a.microbatch for a in scatters] == [1] * 8
    for action in plan:
        if action.kind in (ActionKind.FORWARD, ActionKind.BACKWARD):
            before = plan[:plan.index(action)]
            gathers = [a for a in before if a.stage == action.stage
                       and a.kind in (ActionKind.ALL_GATHER, ActionKind.DROP)]
            assert gathers[-1].kind == ActionKind.ALL_GATHER
    kept = planned_actions(8, 1, reshard_after_forward=False, sync_every_microbatch=True)
    assert peak_gathered(kept) == 8  # ZeRO-2: whole weights from forward to backward


# --- checkpoints of sharded weights resumed at other world sizes, bitwise -------------
def _exact_plain() -> list[dict]:
    """The plain-PyTorch reference of the exact-arithmetic runs, after each call;
    computed in float32 and float64 too, to check that its arithmetic is exact (else
    bitwise equality across world sizes would not be a fair demand)."""
    fp32, fp64 = exact_reference(range(CALLS)), exact_reference(range(CALLS), torch.float64)
    for a, b in zip(fp32, fp64, strict=True):
        assert all(torch.equal(a[k].double(), b[k]) for k in b), "inexact arithmetic"
    return fp32


def _assert_bitwise(weights: dict, expected: dict, what: str) -> None:
    assert weights.keys() >= expected.keys()
    for key, value in expected.items():
        assert torch.equal(weights[key], value), f"{what}: {key} differs"


def _exact_uninterrupted(fsdp_runs) -> tuple[list, dict]:
    """The 2-process run (all three RTS), checked bitwise against plain PyTorch after
    every call; its checkpoint after CALLS // 2 calls, the same on both processes."""
    runs, plain = fsdp_runs("exact"), _exact_plain()
    for rank in (0, 1):
        assert runs[rank]["sharded"] == ["blocks.0.weight", "blocks.1.weight",
                                         "blocks.2.weight"]
        for call in range(CALLS):
            _assert_bitwise(runs[rank]["after"][call], plain[call], f"2 processes, call {call}")
    checkpoint = runs[0]["checkpoint"]
    _assert_bitwise(runs[1]["checkpoint"]["model"], checkpoint["model"], "checkpoints")
    return runs, checkpoint


def _momentum(state_dict: dict) -> list[torch.Tensor]:
    return [state_dict["state"][i]["momentum_buffer"] for i in sorted(state_dict["state"])]


def test_sharded_checkpoint_resumes_unsharded_at_one_process_bitwise(fsdp_runs):
    """Taken with weights, accumulators and optimizer state sharded over 2 processes,
    resumed unsharded in this process (the same global batches, 4 micro-batches): every
    next step's weights, and the momentum at the end, equal the uninterrupted run's and
    plain PyTorch's bit for bit."""
    runs, checkpoint = _exact_uninterrupted(fsdp_runs)
    model = Exact()
    model.load_state_dict(checkpoint["model"])
    optimizer = exact_sgd(model)
    optimizer.load_state_dict(checkpoint["optimizer"])
    training = poptorch.trainingModel(model, exact_options(1, False), optimizer)
    for call in range(CALLS // 2, CALLS):
        training(*exact_batch(call))
        _assert_bitwise(model.state_dict(), runs[0]["after"][call], f"1 process, call {call}")
    for mine, theirs in zip(_momentum(optimizer.state_dict()),
                            _momentum(runs[0]["state_dict"]), strict=True):
        assert torch.equal(mine, theirs)


def test_sharded_checkpoint_resumes_sharded_at_four_processes_bitwise(fsdp_runs, fsdp_out):
    """The same checkpoint resumed with all three RTS over 4 processes (one micro-batch
    each; the blocks' 6, 7 and 3 rows cut 2/2/2/0, 2/2/2/1 and 1/1/1/0): every next
    step's weights, whole on every process, and the momentum at the end equal the
    uninterrupted 2-process run's and plain PyTorch's bit for bit."""
    runs, _ = _exact_uninterrupted(fsdp_runs)
    _torchrun("fsdp_worker.py", fsdp_out, 4, "--resume-exact")
    for rank, resumed in enumerate(_loader(fsdp_out, 4)("exact_resumed4")):
        assert resumed["sharded"] == runs[0]["sharded"]
        for call in range(CALLS // 2, CALLS):
            _assert_bitwise(resumed["after"][call], runs[0]["after"][call],
                            f"4 processes, process {rank}, call {call}")
        for mine, theirs in zip(_momentum(resumed["state_dict"]),
                                _momentum(runs[0]["state_dict"]), strict=True):
            assert torch.equal(mine, theirs)
