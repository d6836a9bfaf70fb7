"""Replicated tensor sharding of the optimizer state across processes: torchrun
``--nproc_per_node=2`` (gloo, one thread each) on tests/memory_worker.py, compared with
the unsharded run, a plain PyTorch loop, and a resumption at world size 1.
"""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest
import torch

from poptorch.enums import CommGroupType
from _memory_cases import (CALLS, Grouped, adamw, grouped_batch, make_model, options,
                           plain_reference, train, train_grouped, M)

HERE = pathlib.Path(__file__).resolve().parent
TOL = 1e-6


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("memory")
    env = dict(os.environ, OMP_NUM_THREADS="1", POPTORCH_DISTRIBUTED_TIMEOUT="60",
               PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone",
         "--nproc_per_node=2", str(HERE / "memory_worker.py"), str(out)],
        cwd=HERE, env=env, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

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
