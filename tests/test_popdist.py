"""PopDist and poprun (issue 24): a PopDist program started with ``poprun
--num-instances 2`` trains to the same weights as one process with all the replicas
and as plain PyTorch; PopDist's answers and errors; poprun's command lines."""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

import poptorch
import popdist
import popdist.poptorch
from popdist_worker import LR, MICRO_BATCH, STEPS, Model, data, train
from poprun.cli import PoprunError, build_plan

HERE = pathlib.Path(__file__).resolve().parent
WORKER = HERE / "popdist_worker.py"
_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                popdist.TOTAL_REPLICAS_ENV, popdist.IPUS_PER_REPLICA_ENV)


def plain_pytorch(total_replicas: int) -> dict:
    model = Model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    x, y = data(total_replicas)
    rows = MICRO_BATCH * total_replicas
    for step in range(STEPS):
        opt.zero_grad()
        xs, ys = x[step * rows:(step + 1) * rows], y[step * rows:(step + 1) * rows]
        # replicas' mean losses, averaged (PopTorch's Mean reduction)
        losses = [model(xs[r * MICRO_BATCH:(r + 1) * MICRO_BATCH],
                        ys[r * MICRO_BATCH:(r + 1) * MICRO_BATCH])[1]
                  for r in range(total_replicas)]
        torch.stack(losses).mean().backward()
        opt.step()
    return model.state_dict()


@pytest.mark.parametrize("replicas", [2, 4])
def test_poprun_two_instances_train_like_one_process_and_plain_pytorch(tmp_path, replicas):
    env = dict(os.environ, OMP_NUM_THREADS="1", POPTORCH_DISTRIBUTED_TIMEOUT="30",
               PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    for var in _LAUNCH_VARS:
        env.pop(var, None)
    cmd = [sys.executable, "-m", "poprun", "--num-instances", "2", "--num-replicas",
           str(replicas), "--ipus-per-replica", "1", "--numa-aware",
           sys.executable, str(WORKER), str(tmp_path)]
    result = subprocess.run(cmd, cwd=HERE, env=env, capture_output=True, text=True,
                            timeout=180)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stderr.count("--numa-aware: IPU system settings, no effect here") == 1
    local = replicas // 2
    for index in (0, 1):
        facts = json.loads((tmp_path / f"facts_{index}.json").read_text())
        assert facts == {"instances": 2, "index": index, "local": local, "total": replicas,
                         "offset": index * local, "ipus": 1, "replication_factor": local,
                         "process": [index, 2], "saw_checkpoint": True,
                         "returned": 0 if index == 0 else None}
    assert not (tmp_path / "ran_on_1").exists()
    got = [torch.load(tmp_path / f"weights_{i}.pt") for i in (0, 1)]
    one_process = train(poptorch.Options().replicationFactor(replicas), 0, replicas,
                        replicas)
    plain = plain_pytorch(replicas)
    for key, value in plain.items():
        torch.testing.assert_close(got[0][key], got[1][key], rtol=0, atol=0)
        torch.testing.assert_close(got[0][key], one_process[key], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(got[0][key], value, rtol=1e-6, atol=1e-6)
    # the program did learn something: the weights moved
    assert not torch.equal(got[0]["fc.weight"], Model().fc.weight.detach())


# -- PopDist's answers and errors in one process ------------------------------------------
@pytest.fixture
def launched(monkeypatch):
    for var in _LAUNCH_VARS:
        monkeypatch.delenv(var, raising=False)

    def set_env(**values):
        for k, v in values.items():
            monkeypatch.setenv(k, str(v))
    return set_env


def test_outside_a_launcher_popdist_is_one_instance_with_one_replica(launched):
    assert not popdist.isPopdistEnvSet()
    assert (popdist.getNumInstances(), popdist.getInstanceIndex(),
            popdist.getNumTotalReplicas(), popdist.getNumLocalReplicas(),
            popdist.getReplicaIndexOffset(), popdist.getNumIpusPerReplica(),
            popdist.getDeviceId()) == (1, 0, 1, 1, 0, 1, 0)
    opts = popdist.poptorch.Options(ipus_per_replica=2)  # upstream's test_getters
    assert (opts.Distributed.processId, opts.Distributed.numProcesses) == (0, 1)
    assert popdist.execute_on_instances({0}, lambda a, b=0: a + b, 1, b=2) == 3
    popdist.synchronize()  # one instance: nothing to wait for


def test_answers_follow_the_launchers_environment(launched):
    launched(RANK=1, WORLD_SIZE=2, LOCAL_RANK=1, POPDIST_NUM_TOTAL_REPLICAS=8,
             POPDIST_NUM_IPUS_PER_REPLICA=2)
    assert popdist.isPopdistEnvSet()
    assert (popdist.getNumInstances(), popdist.getInstanceIndex(),
            popdist.getNumTotalReplicas(), popdist.getNumLocalReplicas(),
            popdist.getReplicaIndexOffset(), popdist.getNumIpusPerReplica(),
            popdist.getDeviceId()) == (2, 1, 8, 4, 4, 2, 1)
    opts = popdist.poptorch.Options(ipus_per_replica=2)
    assert opts.replication_factor == 4
    assert (opts.Distributed.processId, opts.Distributed.numProcesses) == (1, 2)
    with pytest.raises(popdist.PopdistError, match="disagrees with poprun --ipus-per-replica 2"):
        popdist.poptorch.Options(ipus_per_replica=1)


def test_plain_torchrun_gives_one_replica_per_instance(launched):
    launched(RANK=0, WORLD_SIZE=2, LOCAL_RANK=0)
    assert popdist.isPopdistEnvSet()
    assert popdist.getNumTotalReplicas() == 2 and popdist.getNumLocalReplicas() == 1


@pytest.mark.parametrize("call", ["useIpuId", "replicationFactor", "Distributed.disable",
                                  "Distributed.setEnvVarNames",
                                  "Distributed.configureProcessId"])
def test_popdist_options_refuse_what_the_launcher_decides(launched, call):
    # upstream's tests/popdist_test.py::test_blocked_options
    opts = popdist.poptorch.Options(ipus_per_replica=2)
    target = opts.Distributed if call.startswith("Distributed.") else opts
    method = getattr(target, call.split(".")[-1])
    args = {"useIpuId": (1,), "replicationFactor": (1,), "disable": (),
            "setEnvVarNames": ("A", "B"), "configureProcessId": (1, 2)}[call.split(".")[-1]]
    with pytest.raises(RuntimeError, match=rf"Cannot call `{call}` with popdist\.poptorch"):
        method(*args)
    with pytest.raises(poptorch.Error):
        method(*args)
    # the copy a model makes keeps the rule; other options still change
    clone = opts.clone()
    assert type(clone.Distributed) is type(opts.Distributed)
    with pytest.raises(RuntimeError):
        clone.replicationFactor(2)
    clone.deviceIterations(2)
    assert clone.device_iterations == 2 and clone.replication_factor == 1


def test_misuse_is_a_clear_error(launched):
    launched(RANK=0, WORLD_SIZE=2, POPDIST_NUM_TOTAL_REPLICAS=3)
    with pytest.raises(popdist.PopdistError, match="3 replicas .* cannot be shared by 2"):
        popdist.getNumLocalReplicas()
    launched(POPDIST_NUM_TOTAL_REPLICAS=2)
    with pytest.raises(popdist.PopdistError, match="call popdist.init\\(\\) first"):
        popdist.synchronize()
    with pytest.raises(popdist.PopdistError, match=r"instances \[5\] do not exist"):
        popdist.execute_on_instances({5}, print)
    with pytest.raises(popdist.PopdistError, match="must be a set of instance indices"):
        popdist.execute_on_instances(0, print)
    launched(RANK=2)
    with pytest.raises(popdist.PopdistError, match="RANK=2 is not below WORLD_SIZE=2"):
        popdist.getInstanceIndex()


# -- poprun's command lines -------------------------------------------------------------
def test_poprun_one_host_maps_to_torchrun_standalone():
    plan = build_plan(["--num-instances", "2", "--num-replicas", "4", "--ipus-per-replica",
                       "2", "--vipu-partition", "p", "--only-output-from-instance", "1",
                       "--executable-cache-path", "/c", "-x", "A=1",
                       "python", "train.py", "--num-replicas", "9"])
    assert plan.runs_here and plan.ignored == ["--vipu-partition"]
    assert plan.commands == [["torchrun", "--standalone", "--nproc-per-node", "2",
                              "--no-python", "--local-ranks-filter", "1",
                              "python", "train.py", "--num-replicas", "9"]]
    assert plan.env == {"POPDIST_NUM_TOTAL_REPLICAS": "4",
                        "POPDIST_NUM_IPUS_PER_REPLICA": "2",
                        "POPTORCH_CACHE_DIR": "/c", "A": "1"}


def test_poprun_several_hosts_gives_one_torchrun_command_per_host(capsys):
    from poprun.cli import main
    assert main(["--host", "h0,h1", "--num-instances", "4", "--num-replicas", "4",
                 "python", "t.py"]) == 0
    out = capsys.readouterr()
    assert "2 hosts: run on each host" in out.err
    lines = [line for line in out.out.splitlines() if line.startswith("POPDIST")]
    assert len(lines) == 2
    for rank, line in enumerate(lines):
        assert f"--nnodes 2 --node-rank {rank} --rdzv-backend c10d --rdzv-endpoint " \
               "h0:29400" in line and "--nproc-per-node 2 --no-python python t.py" in line


@pytest.mark.parametrize("argv, message", [
    (["--num-instances", "2", "--num-replicas", "3", "python", "t.py"],
     "--num-replicas 3 is not a multiple of --num-instances 2"),
    (["--num-replicas", "2"], "no program given"),
    (["--num-instances", "3", "--num-replicas", "3", "--host", "a,b", "python", "t.py"],
     "cannot be spread evenly over 2 hosts"),
    (["--num-instances", "0", "--num-replicas", "2", "python", "t.py"],
     "--num-instances must be >= 1"),
])
def test_poprun_refuses_command_lines_it_cannot_run(argv, message):
    with pytest.raises(PoprunError, match=message):
        build_plan(argv)
