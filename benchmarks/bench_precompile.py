"""Start-up time of a fresh process: compiling from scratch vs loading a precompiled
file vs a warm executable cache, side by side in one run (inductor backend).

For each workload (a small CNN, a small GPT) and mode (training, inference), three
fresh processes time the first two calls of the model (the inductor backend compiles
at the second), from wrapping (or loading) to the second call's end, with torch's compiler caches empty (``TORCHINDUCTOR_CACHE_DIR`` points at a
new folder, as on a new machine):

* ``cold``: wrap the model and call it: torch.compile generates and builds every
  kernel. The same process then writes the precompiled file (``save``); its first call
  also stored the program in the executable cache (``enableExecutableCaching``);
* ``load``: ``poptorch.load(file)`` and call it;
* ``cache``: wrap a new model with the same options and cache folder and call it.

The eager backend's first call is printed for reference (it compiles nothing). The
target: load and cache first calls <= 0.3x the cold compile. Rounds interleave the
three kinds; the median is reported.

Run: ``python benchmarks/bench_precompile.py [--rounds N] [--workloads cnn,gpt]
[--modes training,inference]``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from workloads import CNN, GPT  # noqa: E402  (benchmarks/workloads.py)

TARGET = 0.3


def build(workload: str):
    """(model, example inputs) for ``workload``; deterministic."""
    torch.manual_seed(0)
    if workload == "cnn":
        return CNN(), (torch.randn(32, 1, 28, 28), torch.randint(0, 10, (32,)))
    idx = torch.randint(0, 256, (8, 33))
    return GPT(vocab=256), (idx[:, :-1].contiguous(), idx[:, 1:].contiguous())


def wrap(model, training: bool, backend: str, cache: str | None):
    import poptorch
    opts = poptorch.Options().deviceIterations(2)
    opts.showCompilationProgressBar(False)
    opts.Jit.backend(backend)
    if cache is not None:
        opts.enableExecutableCaching(cache)
    if training:
        return poptorch.trainingModel(model, opts,
                                      torch.optim.AdamW(model.parameters(), lr=1e-3))
    return poptorch.inferenceModel(model, opts)


def child(kind: str, workload: str, training: bool, path: str, cache: str) -> dict:
    """One fresh process: time the first call (module docstring)."""
    import poptorch
    model, inputs = build(workload)
    t0 = time.perf_counter()
    if kind == "load":
        pop = poptorch.load(path)
    else:
        pop = wrap(model, training, "eager" if kind == "eager" else "inductor",
                   None if kind == "eager" else cache)
    pop(*inputs)
    first = time.perf_counter() - t0
    t1 = time.perf_counter()
    pop(*inputs)
    second = time.perf_counter() - t1
    if kind == "cold":
        pop.save(path)
    # The inductor backend compiles at the second call (the first runs eagerly), so
    # the start-up cost is the time until two calls are done.
    return {"first": first + second, "second": second}


def run_child(kind: str, workload: str, training: bool, path: str, cache: str) -> dict:
    inductor = tempfile.mkdtemp(prefix="bench-inductor-")  # empty compiler caches
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=inductor, POPTORCH_LOG_LEVEL="ERR")
    out = subprocess.run([sys.executable, __file__, "--child", kind, workload,
                          "1" if training else "0", path, cache],
                         env=env, capture_output=True, text=True, timeout=3600)
    if out.returncode != 0:
        raise RuntimeError(f"{kind} {workload} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--workloads", default="cnn,gpt")
    parser.add_argument("--modes", default="training,inference")
    parser.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        kind, workload, training, path, cache = args.child
        print(json.dumps(child(kind, workload, training == "1", path, cache)))
        return 0
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, {args.rounds} round(s); "
          "seconds until the first two calls of a fresh process are done (median), "
          "inductor backend, empty torch compiler caches")
    header = (f"{'workload':<6} {'mode':<9} {'eager':>7} {'cold':>8} {'load':>7} "
              f"{'cache':>7} {'load/cold':>10} {'cache/cold':>11}")
    print(header)
    failed = False
    for workload in args.workloads.split(","):
        for mode in args.modes.split(","):
            training = mode == "training"
            times: dict = {"eager": [], "cold": [], "load": [], "cache": []}
            for _ in range(args.rounds):
                with tempfile.TemporaryDirectory() as folder:
                    path = os.path.join(folder, "model.poptorch")
                    cache = os.path.join(folder, "cache")
                    for kind in ("cold", "load", "cache", "eager"):
                        times[kind].append(
                            run_child(kind, workload, training, path, cache)["first"])
            med = {k: statistics.median(v) for k, v in times.items()}
            load_ratio, cache_ratio = med["load"] / med["cold"], med["cache"] / med["cold"]
            failed |= load_ratio > TARGET or cache_ratio > TARGET
            print(f"{workload:<6} {mode:<9} {med['eager']:>7.2f} {med['cold']:>8.2f} "
                  f"{med['load']:>7.2f} {med['cache']:>7.2f} {load_ratio:>9.2f}x "
                  f"{cache_ratio:>10.2f}x", flush=True)
    print(f"target: load and cache <= {TARGET}x cold: {'FAILED' if failed else 'met'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
