"""First calls of a model with the default backend, at growing deviceIterations x
gradientAccumulation: the compile must not grow with them.

For the MLP, the CNN and the small GPT of ``workloads.py``, at ``gradientAccumulation``
1, 8, 64, 512 and ``deviceIterations`` 1 and 16 (training, SGD), each in a process of its
own with an empty inductor cache:

* ``default``: a ``trainingModel`` with no backend option (the automatic backend a user
  gets), called until its backend is decided (the first call eager, then the trial of
  the compiled backend against the eager one), each call timed;
* ``eager``: the same calls on a model with ``Options.Jit.backend("eager")``.

Both sides' first calls are timed whole (wall seconds). The *compile part* is the
first compiled call (the second call) beyond a later compiled call of the same model:
what compiling added. It is measured in CPU seconds of this process and of the
compiler processes it waits for (inductor compiles in-process here,
``TORCHINDUCTOR_COMPILE_THREADS=1``), so that other work on a shared machine does not
move it; wall seconds are printed beside. It must grow by at most 1.5x from the
smallest to the largest d x g: the compiled pieces are one micro-batch's forward /
backward and the update, compiled once whatever d and g are (before this design the
whole call was unrolled into one graph: 2.7 s at g=1, 9.2 s at g=64, not finished after
9.5 minutes at g=512 for a 7-layer MLP). Micro-batches are small so that a call of 8192
of them stays affordable.

Run: ``python benchmarks/bench_compile_scaling.py [--quick] [--workload mlp|cnn|gpt]``
(``--quick``: g in 1, 64 and d in 1, 16). Prints one row per configuration, then the
growth of each workload's compile part; about 15 minutes on a quiet 2-core machine
(``--quick``: about 4).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from workloads import WORKLOADS  # noqa: E402  (benchmarks/workloads.py)

GROWTH_TARGET = 1.5
MICRO = {"mlp": 4, "cnn": 4, "gpt": 1}  # rows per micro-batch
MAX_CALLS = 60  # a trial that has not decided by then is reported as such


def _model(name, d, g, backend):
    import poptorch
    kind = WORKLOADS[name][0]
    torch.manual_seed(0)
    model = kind()
    opts = poptorch.Options().deviceIterations(d)
    opts.Training.gradientAccumulation(g)
    opts.showCompilationProgressBar(False)
    if backend is not None:
        opts.Jit.backend(backend)
    return poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.01))


def _cpu_seconds() -> float:
    """CPU seconds of this process and of the child processes it has waited for (the
    C++ compiler runs inductor starts)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _timed_call(model, x, y) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), _cpu_seconds()
    model(x, y)
    return time.perf_counter() - wall, _cpu_seconds() - cpu


def measure(name, d, g, micro):
    """One configuration, in this process: returns a result row."""
    _, _, make_x, make_y = WORKLOADS[name]
    gen = torch.Generator().manual_seed(0)
    rows = d * g * micro
    x, y = make_x(rows, gen), make_y(rows, gen)
    eager = _model(name, d, g, "eager")
    eager_times = [_timed_call(eager, x, y)]  # (warms the host, as a user's first call)
    default = _model(name, d, g, None)
    times = []
    while len(times) < MAX_CALLS:
        times.append(_timed_call(default, x, y))
        if default.backendInUse in ("compiled", "eager") and len(times) > 1:
            break
    decided = default.backendInUse
    eager_times += [_timed_call(eager, x, y) for _ in times[1:]]
    # calls 2, 4, 6, ... of the default side ran the compiled backend (the trial
    # alternates, compiled first); the first of them compiled
    compiled = times[1::2]
    parts = [compiled[0][k] - statistics.median(c[k] for c in compiled[1:])
             if len(compiled) > 1 else float("nan") for k in (0, 1)]
    return {"workload": name, "d": d, "g": g, "calls": len(times), "decided": decided,
            "eager_s": sum(t[0] for t in eager_times), "default_s": sum(t[0] for t in times),
            "compile_wall_s": parts[0], "compile_cpu_s": parts[1]}


def report(results):
    print("First calls until the default backend has decided (wall s), both sides, and "
          "the compile part (CPU s; wall s beside):")
    print(f"{'workload':<9}{'d':>4}{'g':>5}{'d*g':>6}{'calls':>7}{'eager s':>10}"
          f"{'default s':>11}{'compile CPU s':>15}{'wall s':>9}  backend")
    for r in results:
        print(f"{r['workload']:<9}{r['d']:>4}{r['g']:>5}{r['d'] * r['g']:>6}{r['calls']:>7}"
              f"{r['eager_s']:>10.2f}{r['default_s']:>11.2f}{r['compile_cpu_s']:>15.2f}"
              f"{r['compile_wall_s']:>9.2f}  {r['decided']}")
    print()
    failed = []
    for name in sorted({r["workload"] for r in results}):
        rows = sorted((r for r in results if r["workload"] == name),
                      key=lambda r: r["d"] * r["g"])
        if len(rows) < 2:
            continue
        small, large = rows[0], rows[-1]
        growth = large["compile_cpu_s"] / max(small["compile_cpu_s"], 1e-3)
        ok = growth <= GROWTH_TARGET
        failed += [] if ok else [name]
        print(f"{name}: compile part {small['compile_cpu_s']:.2f} CPU s at "
              f"d*g={small['d'] * small['g']} -> {large['compile_cpu_s']:.2f} CPU s at "
              f"d*g={large['d'] * large['g']}: {growth:.2f}x (target <= {GROWTH_TARGET}x) "
              f"{'ok' if ok else 'NOT MET'}")
    return failed


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="g in 1, 64; d in 1, 16")
    parser.add_argument("--workload", choices=sorted(MICRO), action="append",
                        help="only these workloads (default: all)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--strict", action="store_true",
                        help="exit with status 1 when a target is not met")
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)  # name d g json
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.child:
        name, d, g, out = args.child
        row = measure(name, int(d), int(g), MICRO[name])
        with open(out, "w") as f:
            json.dump(row, f)
        return 0
    gs = (1, 64) if args.quick else (1, 8, 64, 512)
    results = []
    for name in args.workload or sorted(MICRO):
        for d in (1, 16):
            for g in gs:
                with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
                    out = f.name
                env = dict(os.environ, POPTORCH_LOG_LEVEL="WARN",
                           POPTORCH_BACKEND_DECISIONS="off", TORCHINDUCTOR_COMPILE_THREADS="1",
                           TORCHINDUCTOR_CACHE_DIR=tempfile.mkdtemp(prefix="bench_scaling_"))
                env.pop("POPTORCH_BACKEND", None)  # the default a user gets
                cmd = [sys.executable, os.path.abspath(__file__), "--threads",
                       str(args.threads), "--child", name, str(d), str(g), out]
                subprocess.run(cmd, check=True, env=env)
                with open(out) as f:
                    row = json.load(f)
                os.unlink(out)
                results.append(row)
                print(f"[{name} d={d} g={g}: {row['calls']} calls, compile part "
                      f"{row['compile_cpu_s']:.1f} CPU s]", flush=True)
    failed = report(results)
    return 1 if failed and args.strict else 0


if __name__ == "__main__":
    sys.exit(main())
