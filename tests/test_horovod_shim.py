"""OpenPopTorch's horovod.torch (compat/horovod, issue 24) under torchrun with 2
processes: each call's result against the same reduction computed with plain torch in
this process from both ranks' inputs."""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest
import torch

HERE = pathlib.Path(__file__).resolve().parent
COMPAT = HERE.parent / "compat" / "horovod" / "src"
sys.path.insert(0, str(HERE))
from horovod_worker import rank_tensor  # noqa: E402


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("hvd")
    env = dict(os.environ, OMP_NUM_THREADS="1", POPTORCH_DISTRIBUTED_TIMEOUT="30",
               PYTHONPATH=os.pathsep.join([str(COMPAT), str(HERE),
                                           os.environ.get("PYTHONPATH", "")]))
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc_per_node=2", str(HERE / "horovod_worker.py"), str(out)]
    result = subprocess.run(cmd, cwd=HERE, env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in (0, 1)]


def test_ranks_and_sizes(results):
    for r, res in enumerate(results):
        assert (res["size"], res["rank"], res["local_rank"], res["local_size"]) == (2, r, r, 2)


def test_reductions_match_plain_torch(results):
    a, b = rank_tensor(0), rank_tensor(1)
    expected = {"average": (a + b) / 2, "average_flag": (a + b) / 2, "sum": a + b,
                "sum_flag": a + b, "min": torch.minimum(a, b), "inplace": a + b,
                "scaled": (2 * a + 2 * b) * 0.5,
                "fp16": ((a.half() + b.half()).float() / 2),
                "int_sum": torch.tensor(3 + 4)}
    for res in results:
        for key, value in expected.items():
            torch.testing.assert_close(res[key], value, rtol=0, atol=0, msg=key)
        assert res["int_sum"].dtype == torch.int64
        torch.testing.assert_close(res["grouped"][0], (a + b) / 2)
        torch.testing.assert_close(res["grouped"][1], torch.tensor([1.5]))
        torch.testing.assert_close(res["grouped_inplace"][0], torch.maximum(a, b))
        torch.testing.assert_close(res["grouped_inplace"][1], torch.tensor([2.0]))


def test_gathers_and_broadcasts(results):
    gathered = torch.cat([torch.full((1, 2), 0.0), torch.full((2, 2), 1.0)])
    for res in results:
        torch.testing.assert_close(res["allgather"], gathered, rtol=0, atol=0)
        torch.testing.assert_close(res["allgather_scalar"], torch.tensor([0.0, 1.0]))
        torch.testing.assert_close(res["broadcast"], rank_tensor(1), rtol=0, atol=0)
        torch.testing.assert_close(res["broadcast_inplace"], rank_tensor(1), rtol=0, atol=0)
        assert res["object"] == {"seed": 101} and res["objects"] == [0, 10]
    # parameters and optimizer state: rank 0's everywhere
    for key in results[0]["weights"]:
        torch.testing.assert_close(results[1]["weights"][key], results[0]["weights"][key],
                                   rtol=0, atol=0)
    o0, o1 = results[0]["optimizer"], results[1]["optimizer"]
    assert o1["param_groups"][0]["lr"] == o0["param_groups"][0]["lr"] == 0.1
    for i in o0["state"]:
        torch.testing.assert_close(o1["state"][i]["momentum_buffer"],
                                   o0["state"][i]["momentum_buffer"], rtol=0, atol=0)


def test_one_process_and_misuse(monkeypatch):
    monkeypatch.syspath_prepend(str(COMPAT))
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.delitem(sys.modules, "horovod", raising=False)
    monkeypatch.delitem(sys.modules, "horovod.torch", raising=False)
    import horovod.torch as hvd
    assert pathlib.Path(hvd.__file__).is_relative_to(COMPAT)
    hvd.shutdown()
    with pytest.raises(hvd.HorovodError, match="call hvd.init\\(\\) first"):
        hvd.rank()
    hvd.init()
    x = torch.randn(3)
    torch.testing.assert_close(hvd.allreduce(x), x, rtol=0, atol=0)
    assert hvd.allreduce(x) is not x and hvd.allreduce_(x) is x
    assert (hvd.size(), hvd.rank(), hvd.local_rank()) == (1, 0, 0)
    with pytest.raises(hvd.HorovodError, match="Adasum is not supported"):
        hvd.allreduce(x, op=hvd.Adasum)
    with pytest.raises(hvd.HorovodError, match="either average= .* or op="):
        hvd.allreduce(x, average=True, op=hvd.Sum)
    with pytest.raises(AttributeError, match="DistributedOptimizer is not provided"):
        hvd.DistributedOptimizer  # noqa: B018
