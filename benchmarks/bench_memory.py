"""Memory at scale: PopTorch's tensor locations beside torch's FSDP2 and ZeRO-1, under
``torchrun`` at 2 and 4 processes (gloo, CPU, one thread each).

Every configuration trains 8 x Linear(768, 768) (tanh between) with AdamW on the same
global batches, one micro-batch per process per step:

* ``default``: ``poptorch.trainingModel``, nothing sharded;
* ``optimizer rts``: ``setOptimizerLocation(...useReplicatedTensorSharding(True))``;
* ``all rts``: weights, accumulators and optimizer state with RTS (FSDP2 underneath);
* ``all off chip``: the three ``useOnChipStorage(False)`` with RTS (on the CPU host
  memory is the device's: FSDP2's offload policy only on GPUs);
* ``sharded all rts``: ``all rts`` for the model split in two stages
  (``ShardedExecution``): the weights sharded between steps, whole during a step
  (``_runtime/memory/step_shards.py``);
* ``torch fsdp2``: ``fully_shard`` per Linear and on the model, ``torch.optim.AdamW``;
* ``torch zero1``: DDP and ``ZeroRedundancyOptimizer(AdamW)``.

Per process (the largest over the processes): live tensor bytes after the steps
(every tensor the garbage collector sees, each storage once, a DTensor by its local
shard), peak RSS, and steps/s over the timed steps; the weights after 3 steps against a
plain-PyTorch loop on the global batches (fp32, max abs difference). Ratios against
``torch fsdp2``. Targets: ``all rts`` live bytes <= 1.10x FSDP2's, steps/s >= 0.90x,
weights within 1e-6.

Run: ``python benchmarks/bench_memory.py [--procs 2 4] [--steps 8] [--repeat 1]``.
``--repeat N`` runs the configurations N times round-robin and keeps each one's best
steps/s (on a shared, loaded machine one run's rates move by 2x with the load).
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import resource
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from workloads import live_tensor_bytes

WIDTH, DEPTH, ROWS, LR = 768, 8, 8, 1e-3
CHECK_STEPS = 3
CONFIGS = ("default", "optimizer rts", "all rts", "all off chip", "sharded all rts",
           "torch fsdp2", "torch zero1")


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(WIDTH, WIDTH)
                                          for _ in range(DEPTH))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x, (x ** 2).mean()


def batch(step: int, world: int) -> torch.Tensor:
    return torch.randn(world * ROWS, WIDTH, generator=torch.Generator().manual_seed(step))


def _poptorch_step(config: str, model: Net, rank: int, world: int):
    import poptorch
    opts = poptorch.Options()
    settings = poptorch.TensorLocationSettings()
    settings.useReplicatedTensorSharding(config != "default")
    settings.minElementsForReplicatedTensorSharding(1024)
    if config == "all off chip":
        settings.useOnChipStorage(False)
    opts.TensorLocations.setOptimizerLocation(settings)
    if config in ("all rts", "all off chip", "sharded all rts"):
        opts.TensorLocations.setWeightLocation(settings)
        opts.TensorLocations.setAccumulatorLocation(settings)
    if config == "sharded all rts":  # two stages: sharded between steps (step_shards)
        poptorch.BeginBlock(model.layers[0], "first", ipu_id=0)
        poptorch.BeginBlock(model.layers[DEPTH // 2], "second", ipu_id=1)
        opts.setExecutionStrategy(poptorch.ShardedExecution())
    optimizer = poptorch.optim.AdamW(model.parameters(), lr=LR)
    training = poptorch.trainingModel(model, opts, optimizer)

    def step(n: int) -> None:
        training(batch(n, world)[rank * ROWS:(rank + 1) * ROWS])
    return step


def _torch_step(config: str, model: Net, rank: int, world: int):
    import torch.distributed as dist
    if config == "torch fsdp2":
        from torch.distributed.fsdp import fully_shard
        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
        net = model
    else:
        from torch.distributed.optim import ZeroRedundancyOptimizer
        net = torch.nn.parallel.DistributedDataParallel(model, process_group=dist.group.WORLD)
        optimizer = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=LR)

    def step(n: int) -> None:
        optimizer.zero_grad(set_to_none=True)
        net(batch(n, world)[rank * ROWS:(rank + 1) * ROWS])[1].backward()
        optimizer.step()
    return step


def full_weights(model: Net) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
            for k, v in model.state_dict().items()}


def worker(config: str, out: str, steps: int) -> None:
    """One configuration in one process of a torchrun job."""
    import torch.distributed as dist
    os.environ.setdefault("POPTORCH_BACKEND", "eager")
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = Net()
    make = _torch_step if config.startswith("torch") else _poptorch_step
    step = make(config, model, rank, world)
    for n in range(CHECK_STEPS):
        step(n)
    weights = full_weights(model)
    start = time.perf_counter()
    for n in range(CHECK_STEPS, steps):
        step(n)
    rate = (steps - CHECK_STEPS) / (time.perf_counter() - start)
    result = {"live": live_tensor_bytes(), "rate": rate,
              "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    if rank == 0:
        reference = Net()
        optimizer = torch.optim.AdamW(reference.parameters(), lr=LR)
        for n in range(CHECK_STEPS):
            optimizer.zero_grad()
            reference(batch(n, world))[1].backward()
            optimizer.step()
        result["diff"] = max((weights[k] - v).abs().max().item()
                             for k, v in reference.state_dict().items())
    pathlib.Path(out, f"r{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def launch(config: str, procs: int, steps: int) -> dict:
    with tempfile.TemporaryDirectory() as out:
        env = dict(os.environ, OMP_NUM_THREADS="1")
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        f"--nproc_per_node={procs}", __file__, "--worker", config,
                        "--out", out, "--steps", str(steps)],
                       env=env, check=True, capture_output=True)
        parts = [json.loads(pathlib.Path(out, f"r{r}.json").read_text())
                 for r in range(procs)]
    return {"live": max(p["live"] for p in parts), "rss": max(p["rss"] for p in parts),
            "rate": min(p["rate"] for p in parts), "diff": parts[0]["diff"]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker")
    parser.add_argument("--out")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--procs", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--repeat", type=int, default=1)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.out, args.steps)
        return
    for procs in args.procs:
        results: dict[str, dict] = {}
        for _ in range(args.repeat):
            for c in CONFIGS:
                r = launch(c, procs, args.steps)
                if c not in results or r["rate"] > results[c]["rate"]:
                    results[c] = r
        peer = results["torch fsdp2"]
        print(f"\n{procs} processes (per process, worst; ratios vs torch fsdp2; steps/s "
              f"the best of {args.repeat} run(s) of {args.steps - CHECK_STEPS} timed steps)")
        print(f"{'config':14} {'live MiB':>9} {'x fsdp2':>8} {'RSS MiB':>8} "
              f"{'steps/s':>8} {'x fsdp2':>8} {'max|w-ref|':>11}")
        for config, r in results.items():
            print(f"{config:14} {r['live'] / 2**20:9.1f} {r['live'] / peer['live']:8.2f} "
                  f"{r['rss'] / 2**20:8.0f} {r['rate']:8.2f} {r['rate'] / peer['rate']:8.2f} "
                  f"{r['diff']:11.1e}")


if __name__ == "__main__":
    main()
