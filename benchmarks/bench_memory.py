"""Memory at scale: replicated tensor sharding and off-chip optimizer state vs torch's
ZeRO and FSDP2, under ``torchrun --nproc_per_node=2`` (gloo, CPU, one thread each).

Every configuration trains the same MLP of a few million parameters with AdamW on the
same micro-batches (one per process per step), in fresh processes so that each peak RSS
is its own:

* ``poptorch``: ``poptorch.trainingModel`` with ``poptorch.optim.AdamW``;
* ``poptorch rts``: the same with
  ``setOptimizerLocation(TensorLocationSettings().useReplicatedTensorSharding(True))``;
* ``poptorch off-chip``: ``useOnChipStorage(False)`` for the optimizer state (on the CPU
  host memory is the device's: nothing moves, as documented);
* ``poptorch rts+off-chip``: both;
* ``torch DDP``: plain PyTorch, DDP and ``torch.optim.AdamW`` (the reference);
* ``torch ZeRO``: DDP and ``torch.distributed.optim.ZeroRedundancyOptimizer(AdamW)``;
* ``torch FSDP2``: ``torch.distributed.fsdp.fully_shard`` on each layer and the model.

Reported per process (the larger of the two): bytes of optimizer state held, peak RSS
(large blocks returned to the system when freed: ``MALLOC_MMAP_THRESHOLD_``) and its growth from the end of model construction to the end of training (one pair of
fresh processes per configuration), and the median step time, measured in one more
pair of processes that trains every configuration in turn, a few steps each, round
after round, so that machine noise hits all of them alike. Ratios: against the unsharded ``poptorch`` run (the TARGET: ``rts``
state <= 0.55x, step time of ``rts`` no more than 1/0.9 of ``poptorch``'s) and against
the torch peers.

Run: ``flock -x /tmp/cpu.lock python benchmarks/bench_memory.py [--quick]``.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist

WIDTHS = (1024, 1536, 1536, 1024)
BATCH = 16
LR = 1e-3
CONFIGS = ("poptorch", "poptorch rts", "poptorch off-chip", "poptorch rts+off-chip",
           "torch DDP", "torch ZeRO", "torch FSDP2")


class MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        layers = []
        for a, b in zip(WIDTHS[:-1], WIDTHS[1:], strict=False):
            layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
        self.layers = torch.nn.Sequential(*layers[:-1])

    def forward(self, x, y):
        out = self.layers(x)
        return out, torch.nn.functional.mse_loss(out, y)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _state_bytes(state) -> int:
    seen, total = set(), 0
    for entry in state.values():
        for value in entry.values():
            if not isinstance(value, torch.Tensor):
                continue
            if hasattr(value, "to_local"):  # DTensor: this process's shard
                value = value.to_local()
            storage = value.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
    return total


def _batches(steps: int, rank: int):
    g = torch.Generator().manual_seed(1 + rank)
    return [(torch.randn(BATCH, WIDTHS[0], generator=g),
             torch.randn(BATCH, WIDTHS[-1], generator=g)) for _ in range(steps)]


def _poptorch(config: str, model):
    """A step function and a reader of the optimizer state bytes held."""
    import poptorch
    opts = poptorch.Options()
    settings = poptorch.TensorLocationSettings()
    if "rts" in config:
        settings.useReplicatedTensorSharding(True)
    if "off-chip" in config:
        settings.useOnChipStorage(False)
    opts.TensorLocations.setOptimizerLocation(settings)
    optimizer = poptorch.optim.AdamW(model.parameters(), lr=LR)
    training = poptorch.trainingModel(model, opts, optimizer)

    def held() -> int:
        managed = training._program.managed_step
        return _state_bytes(optimizer.state) + (
            managed.local_state_bytes() if managed is not None else 0)
    return training, held


def _torch(config: str, model):
    if config == "torch FSDP2":
        from torch.distributed.fsdp import fully_shard
        for layer in model.layers:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
        forward = fully_shard(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    else:
        forward = torch.nn.parallel.DistributedDataParallel(model)
        if config == "torch ZeRO":
            from torch.distributed.optim import ZeroRedundancyOptimizer
            optimizer = ZeroRedundancyOptimizer(model.parameters(),
                                                optimizer_class=torch.optim.AdamW, lr=LR)
        else:
            optimizer = torch.optim.AdamW(model.parameters(), lr=LR)

    def step(x, y) -> None:
        optimizer.zero_grad(set_to_none=True)
        forward(x, y)[1].backward()
        optimizer.step()
    inner = getattr(optimizer, "optim", optimizer)  # ZeRO's local optimizer
    return step, lambda: _state_bytes(inner.state)


def _build(config: str, model):
    return (_poptorch if config.startswith("poptorch") else _torch)(config, model)


def _timed(step, batches) -> list:
    times = []
    for x, y in batches:
        start = time.perf_counter()
        step(x, y)
        times.append(time.perf_counter() - start)
    return times


def worker(config: str, out: str, steps: int) -> None:
    """Memory of one configuration (``config``), or every configuration's step time
    (``config == "timing"``), in this pair of processes."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    batches = _batches(steps, rank)
    if config == "timing":
        steps_per_round = 3
        runs = {}
        for name in CONFIGS:
            torch.manual_seed(0)
            runs[name] = _build(name, MLP())[0]
            _timed(runs[name], batches[:2])  # compile, first steps
        times: dict = {name: [] for name in CONFIGS}
        for start in range(0, steps, steps_per_round):
            for name in CONFIGS:
                dist.barrier()
                times[name] += _timed(runs[name], batches[start:start + steps_per_round])
        result = {name: statistics.median(t) for name, t in times.items()}
    else:
        torch.manual_seed(0)
        model = MLP()
        dist.barrier()
        rss_before = _rss_bytes()
        step, held = _build(config, model)
        _timed(step, batches)
        dist.barrier()
        result = {"state_bytes": held(), "peak_rss": _peak_rss_bytes(),
                  "rss_growth": _peak_rss_bytes() - rss_before,
                  "params": sum(p.numel() for p in model.parameters())}
    pathlib.Path(out, f"{config.replace(' ', '_')}_{rank}.json").write_text(json.dumps(result))
    dist.barrier()  # leave the group together (see gpu_bench.ddp_worker)
    dist.destroy_process_group()


def launch(config: str, out: str, steps: int) -> list:
    # Large blocks straight from mmap and back on free (glibc's threshold otherwise
    # grows and freed temporaries stay in the heap): the peak RSS then follows the
    # memory really in use, the same rule for every configuration.
    env = dict(os.environ, OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="131072")
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc_per_node=2", __file__, "--worker", config, "--out", out,
           "--steps", str(steps)]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=200)
    if result.returncode != 0:
        raise SystemExit(f"{config} failed:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}")
    return [json.loads(pathlib.Path(out, f"{config.replace(' ', '_')}_{r}.json").read_text())
            for r in (0, 1)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker")
    parser.add_argument("--out")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.out, args.steps)
        return
    steps = 6 if args.quick else args.steps
    rows = {}
    with tempfile.TemporaryDirectory() as out:
        for config in CONFIGS:
            per_rank = launch(config, out, 4 if args.quick else 6)
            rows[config] = {key: max(r[key] for r in per_rank)
                            for key in ("state_bytes", "peak_rss", "rss_growth")}
            rows[config]["params"] = per_rank[0]["params"]
        timing = launch("timing", out, steps)
        for config in CONFIGS:
            rows[config]["step_s"] = max(r[config] for r in timing)
    mib = 1024 * 1024
    base = rows["poptorch"]
    print(f"MLP {'-'.join(map(str, WIDTHS))}: {base['params'] / 1e6:.2f} M parameters, "
          f"AdamW, 2 processes (gloo, 1 thread each), batch {BATCH} per process; "
          f"per process, the larger of the two; step time: median of {steps} steps, "
          f"configurations interleaved")
    print(f"{'config':24} {'opt state MiB':>13} {'x poptorch':>10} {'peak RSS MiB':>12} "
          f"{'RSS growth MiB':>14} {'step ms':>8} {'speed x poptorch':>16}")
    for config, row in rows.items():
        print(f"{config:24} {row['state_bytes'] / mib:13.1f} "
              f"{row['state_bytes'] / base['state_bytes']:10.3f} "
              f"{row['peak_rss'] / mib:12.1f} {row['rss_growth'] / mib:14.1f} "
              f"{row['step_s'] * 1e3:8.1f} {base['step_s'] / row['step_s']:16.3f}")
    rts = rows["poptorch rts"]
    state_ratio = rts["state_bytes"] / base["state_bytes"]
    speed_ratio = base["step_s"] / rts["step_s"]
    print(f"TARGET sharded state per process <= 0.55x unsharded: {state_ratio:.3f}x "
          f"({'met' if state_ratio <= 0.55 else 'MISSED'})")
    print(f"TARGET sharded step speed >= 0.9x unsharded: {speed_ratio:.3f}x "
          f"({'met' if speed_ratio >= 0.9 else 'MISSED'})")
    for peer in ("torch DDP", "torch ZeRO", "torch FSDP2"):
        print(f"poptorch rts vs {peer}: state "
              f"{rts['state_bytes'] / rows[peer]['state_bytes']:.3f}x, speed "
              f"{rows[peer]['step_s'] / rts['step_s']:.3f}x, peak RSS "
              f"{rts['peak_rss'] / rows[peer]['peak_rss']:.3f}x")


if __name__ == "__main__":
    main()
