"""Replication across processes: trainingModel under torchrun vs a hand-written DDP loop.

For 1 and 2 processes (torchrun --standalone, gloo, one thread per process) and the mlp
and cnn workloads, each process trains two identical copies of the model on the same
micro-batches: one with ``poptorch.trainingModel`` (``deviceIterations`` steps per call,
gradients summed over the processes once per step), one with
``torch.nn.parallel.DistributedDataParallel`` and a plain loop (zero_grad, forward,
backward, step per micro-batch). Many short rounds alternate which side goes first, and
a round's time is the slowest process's (a step ends when every process has its
gradients). Ours / DDP is the median over rounds of the per-round ratio: two processes on
a shared 2-core machine are noisy, and pairing within a round cancels load that drifts
over seconds, which a ratio of whole-run medians keeps. Prints global samples/s (median
rounds), ours / DDP, and the scaling efficiency from 1 to 2 processes.

Run: ``python benchmarks/bench_distributed.py [--quick]``.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_executor import CNN, MLP, make_batches  # noqa: E402

import poptorch  # noqa: E402

WORKLOADS = {"mlp": (MLP, (784,), 64), "cnn": (CNN, (1, 28, 28), 32)}
STEPS_PER_CALL = 8
TARGET = 0.95  # ours / DDP at 2 processes


def ddp_round(ddp, opt, xs, ys, batch) -> float:
    start = time.perf_counter()
    for x, y in zip(xs.split(batch), ys.split(batch), strict=False):
        opt.zero_grad(set_to_none=True)
        _, loss = ddp(x, y)
        loss.backward()
        opt.step()
    return time.perf_counter() - start


def ours_round(training, xs, ys, batch) -> float:
    per_call = batch * STEPS_PER_CALL
    start = time.perf_counter()
    for x, y in zip(xs.split(per_call), ys.split(per_call), strict=False):
        training(x, y)
    return time.perf_counter() - start


def worker(out: str, rounds: int, calls: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    results = {}
    for name, (cls, shape, batch) in WORKLOADS.items():
        torch.manual_seed(0)
        model = cls()
        ours_model = copy.deepcopy(model)
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        ddp_opt = torch.optim.SGD(model.parameters(), lr=0.01)
        opts = poptorch.Options().deviceIterations(STEPS_PER_CALL)
        opts.showCompilationProgressBar(False)
        training = poptorch.trainingModel(
            ours_model, opts, torch.optim.SGD(ours_model.parameters(), lr=0.01))
        xs, ys = make_batches(shape, batch, calls * STEPS_PER_CALL, seed=rank)
        ours_round(training, xs[:batch * STEPS_PER_CALL], ys[:batch * STEPS_PER_CALL],
                   batch)  # compile
        ddp_round(ddp, ddp_opt, xs[:batch], ys[:batch], batch)  # warm up
        times = torch.zeros(2, rounds, dtype=torch.float64)  # (ours, ddp) x rounds
        for r in range(rounds):
            for side in ((0, 1) if r % 2 == 0 else (1, 0)):
                dist.barrier()
                times[side, r] = ours_round(training, xs, ys, batch) if side == 0 \
                    else ddp_round(ddp, ddp_opt, xs, ys, batch)
        dist.all_reduce(times, op=dist.ReduceOp.MAX)  # the slowest process's round
        samples = len(xs) * world
        ours, ddp_times = times[0].tolist(), times[1].tolist()
        results[name] = {
            "ours": samples / statistics.median(ours),
            "ddp": samples / statistics.median(ddp_times),
            "ratio": statistics.median(d / o for o, d in zip(ours, ddp_times, strict=True)),
        }
        del training, ddp, ddp_opt  # before the process group goes
    if rank == 0:
        pathlib.Path(out).write_text(json.dumps(results))
    dist.barrier()  # leave the group together (see gpu_bench.ddp_worker)
    dist.destroy_process_group()


def launch(processes: int, rounds: int, calls: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        env = dict(os.environ, OMP_NUM_THREADS="1")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={processes}", __file__, "--worker", out,
               "--rounds", str(rounds), "--calls", str(calls)]
        subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, timeout=900)
        return json.loads(pathlib.Path(out).read_text())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--worker")
    parser.add_argument("--rounds", type=int, default=41)
    parser.add_argument("--calls", type=int, default=2)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.rounds, args.calls)
        return
    rounds, calls = (25, 1) if args.quick else (args.rounds, args.calls)
    results = {n: launch(n, rounds, calls) for n in (1, 2)}
    print(f"{'workload':<10}{'processes':>10}{'DDP samples/s':>16}{'ours samples/s':>16}"
          f"{'ours/DDP':>10}   (ours/DDP: median of per-round ratios)")
    for name in WORKLOADS:
        for n in (1, 2):
            r = results[n][name]
            print(f"{name:<10}{n:>10}{r['ddp']:>16.0f}{r['ours']:>16.0f}"
                  f"{r['ratio']:>10.2f}")
    print("\nTarget (issue 26): 2-process training >= 0.95 x the hand-written DDP loop")
    for name in WORKLOADS:
        ratio = results[2][name]["ratio"]
        print(f"  {name:<6} {ratio:.2f}  {'met' if ratio >= TARGET else 'NOT met'}")
    print("\nscaling efficiency 1 -> 2 processes (samples/s at 2 / (2 x at 1)):")
    for name in WORKLOADS:
        eff = {k: results[2][name][k] / (2 * results[1][name][k]) for k in ("ddp", "ours")}
        print(f"  {name:<6} DDP {eff['ddp']:.2f}   ours {eff['ours']:.2f}")


if __name__ == "__main__":
    main()
