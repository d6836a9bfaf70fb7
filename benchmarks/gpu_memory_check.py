"""Peak GPU memory of ``poptorch.trainingModel`` by tensor location (issue 38), a step of
``benchmarks/gpu_check.sh``.

GPT-2 small (12 layers, width 768, 12 heads, vocab 50257; ``workloads.GPT``) trains a
few AdamW steps (fp32, context 128, micro-batch 4, one micro-batch per process) with:

* ``default``: ``poptorch.Options()``;
* ``RTS``: weights, accumulators and optimizer state with
  ``useReplicatedTensorSharding(True)`` (FSDP2 underneath): needs one process per GPU
  and at least 2 of them, so it runs under ``torchrun --nproc_per_node=<GPUs>``, and with
  one GPU the row is skipped and says so;
* ``off chip``: the three ``useOnChipStorage(False)`` (one process alone: the optimizer
  state moves to host memory; weights and accumulators go off chip with RTS only);
* ``off chip + RTS`` (2 GPUs or more): both.

With 2 GPUs or more every row runs in the same torchrun job (one process per GPU), so
the ratios compare like with like. Each row reports ``torch.cuda.max_memory_allocated``
of each process's GPU over the row's whole run (the worst GPU) and its ratio to
``default``. The backend is the eager one and CUDA graphs are off
(``POPTORCH_BACKEND=eager``, ``POPTORCH_CUDA_GRAPHS=0`` unless set): no compile time in
the step's budget, no graph memory pools in the figures.

``--device cpu --tiny`` runs the same code on the CPU with a tiny GPT (gloo;
``--procs 2`` for the RTS rows under torchrun): a check of the script
(tests/test_gpu_memory_check.py). There ``max_memory_allocated`` does not exist and the
column is the live tensor bytes after the steps instead; its numbers mean nothing.

Run: ``python benchmarks/gpu_memory_check.py [--device cpu --tiny] [--procs N]
[--steps 3] [--output REPORT.md]``.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import pathlib
import subprocess
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from workloads import GPT, live_tensor_bytes

FULL = {"vocab": 50257, "width": 768, "heads": 12, "layers": 12, "context": 128}
TINY = {"vocab": 128, "width": 32, "heads": 2, "layers": 2, "context": 16}
BATCH, LR = 4, 1e-4
SINGLE = ("default", "off chip")
SHARDED = ("default", "RTS", "off chip", "off chip + RTS")
ROW_NAMES = {
    "default": "default options",
    "RTS": "weights + accumulators + optimizer RTS",
    "off chip": "weights + accumulators + optimizer off chip",
    "off chip + RTS": "off chip + RTS",
}


def options(config: str, tiny: bool):
    import poptorch
    opts = poptorch.Options()
    opts.showCompilationProgressBar(False)
    if config == "default":
        return opts
    settings = poptorch.TensorLocationSettings()
    if "RTS" in config:
        settings.useReplicatedTensorSharding(True)
        settings.minElementsForReplicatedTensorSharding(64 if tiny else 8192)
    if "off chip" in config:
        settings.useOnChipStorage(False)
    opts.TensorLocations.setWeightLocation(settings)
    opts.TensorLocations.setAccumulatorLocation(settings)
    opts.TensorLocations.setOptimizerLocation(settings)
    return opts


def measure(config: str, device: torch.device, tiny: bool, steps: int, rank: int) -> int:
    """Train ``config`` for ``steps`` steps; its peak bytes on this process's device."""
    import poptorch
    cfg = TINY if tiny else FULL
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    torch.manual_seed(0)
    model = GPT(**cfg)
    optimizer = poptorch.optim.AdamW(model.parameters(), lr=LR)
    training = poptorch.trainingModel(model, options(config, tiny), optimizer)
    g = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        x = torch.randint(0, cfg["vocab"], (BATCH, cfg["context"]), generator=g)
        y = torch.randint(0, cfg["vocab"], (BATCH, cfg["context"]), generator=g)
        training(x, y)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device)
    else:
        peak = live_tensor_bytes()
    training.destroy()
    del training, optimizer, model
    gc.collect()
    return peak


def run_configs(configs: tuple[str, ...], device_type: str, tiny: bool, steps: int,
                out: str | None) -> dict[str, int]:
    """Every config in this process (under torchrun: one process per GPU)."""
    os.environ.setdefault("POPTORCH_BACKEND", "eager")
    os.environ.setdefault("POPTORCH_CUDA_GRAPHS", "0")
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if device_type == "cuda":
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    peaks = {c: measure(c, device, tiny, steps, rank) for c in configs}
    if out is not None:
        pathlib.Path(out, f"r{rank}.json").write_text(json.dumps(peaks))
    return peaks


def launch(procs: int, device_type: str, tiny: bool, steps: int) -> dict[str, int]:
    """The configs under torchrun, ``procs`` processes; each config's worst process."""
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={procs}", os.path.abspath(__file__), "--worker",
               "--out", out, "--device", device_type, "--steps", str(steps)]
        job = subprocess.Popen(cmd + (["--tiny"] if tiny else []), stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True,
                               env=dict(os.environ, OMP_NUM_THREADS="1"))
        try:
            log, _ = job.communicate()
        except KeyboardInterrupt:  # (gpu_check.sh's budget): torchrun stops its workers
            job.terminate()
            try:
                job.wait(10)
            except subprocess.TimeoutExpired:
                job.kill()
            raise
        if job.returncode != 0:
            sys.stderr.write(log[-8000:])
            raise SystemExit(f"gpu_memory_check.py: torchrun failed (exit {job.returncode})")
        parts = [json.loads(pathlib.Path(out, f"r{r}.json").read_text())
                 for r in range(procs)]
    return {c: max(p[c] for p in parts) for c in parts[0]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny GPT: a check of the script")
    parser.add_argument("--procs", type=int, help="processes (default: the GPUs; CPU: 1)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--output", help="append the Markdown here too")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        run_configs(SHARDED, args.device, args.tiny, args.steps, args.out)
        return 0
    if args.device == "cuda":
        if not torch.cuda.is_available():
            print("gpu_memory_check.py: no CUDA GPU found", file=sys.stderr)
            return 2
        found = torch.cuda.device_count()
        unit, units = "GPU", "GPUs"
    else:
        found = args.procs or 1
        unit, units = "process", "processes"
    procs = args.procs or found
    cfg = TINY if args.tiny else FULL
    lines = [f"## Peak memory per {unit} by tensor location: GPT-"
             f"{'tiny' if args.tiny else '2 small'} ({cfg['layers']} layers, width "
             f"{cfg['width']}, vocab {cfg['vocab']}, context {cfg['context']}, micro-batch "
             f"{BATCH}), AdamW, {args.steps} steps, {procs} process(es)\n"]
    if procs >= 2:
        peaks = launch(procs, args.device, args.tiny, args.steps)
        skipped = None
    else:
        peaks = run_configs(SINGLE, args.device, args.tiny, args.steps, None)
        skipped = f"RTS needs 2 {units} ({procs} found): its row is skipped."
        lines.append(skipped + "\n")
    what = ("torch.cuda.max_memory_allocated, worst GPU" if args.device == "cuda" else
            "CPU: live tensor bytes after the steps, worst process")
    lines += [f"| config | MiB ({what}) | x default |", "|---|---|---|"]
    base = peaks["default"]
    for config in SHARDED:
        if config in peaks:
            lines.append(f"| {ROW_NAMES[config]} | {peaks[config] / 2**20:.1f} | "
                         f"{peaks[config] / base:.2f} |")
        elif config == "RTS":
            lines.append(f"| {ROW_NAMES[config]} | skipped: needs 2 {units} | - |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.output:
        with open(args.output, "a") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
