"""poptorch's per-call overhead in machine instructions, against the plain PyTorch loop.

Timings on a shared machine drift by several percent between rounds (the medians of
``bench_compiled.py`` move by +-0.04 from run to run), which is as large as the host
overhead that poptorch adds around a small model's call. Instruction counts do not
drift: this benchmark runs the contenders of ``bench_compiled.py`` under valgrind's
callgrind and counts the instructions each executes per micro-batch, side by side:

* ``eager``: the plain PyTorch loop (per micro-batch: forward; in training zero_grad,
  forward, backward, step);
* ``pop-eager``: the same micro-batches through ``poptorch.inferenceModel`` /
  ``trainingModel`` with the eager backend (``Options.Jit.backend("eager")``): what the
  runtime adds around the model's own code;
* with ``--default``: ``pop``, the default options, after the automatic backend has
  chosen (compiling under valgrind takes minutes).

For each workload, mode and ``deviceIterations`` (1 and 16), the report gives the
instructions per micro-batch, the ratio ``eager / pop-eager`` (1.0: no overhead; read
it like a throughput ratio) and the overhead per call in instructions. Warm-up and
imports run with instrumentation off (``--instr-atstart=no``); each contender is counted
over passes of its micro-batches (8 for the tiny MLP, else 1) between ``callgrind_control``
toggles, less an empty window's count (the toggling itself). One thread, a fixed hash
seed: two runs agree to the third decimal of the ratio. Counts ignore caches and memory
stalls: they bound what the Python-level work costs, not what a timed run shows.

Needs valgrind (``apt install valgrind``); prints why and exits when it is missing.
Run: ``python benchmarks/bench_instructions.py [--quick] [--default]
[--workload tiny|mlp|cnn|gpt]`` (``--quick``: the tiny MLP, about 1.5 minutes on 2 cores;
the default, tiny and MLP, about 25: valgrind runs the MLP's matrix kernels slowly even
where it does not count them). Where compute dominates, the runtime's share is small: the
MLP's training step at d=1 counted 27.46 M instructions per micro-batch in the eager
loop and 27.44 M through poptorch.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import copy
import json
import os
import shutil
import subprocess
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from workloads import WORKLOADS  # (benchmarks/workloads.py)

MICROBATCHES = 16  # micro-batches per pass (a multiple of deviceIterations 16)
PASSES = {"tiny": 8}  # passes counted per window (default 1): rare events (a gc, the
# allocator consolidating) average out over ~20 M instructions


def _control(*flags: str) -> None:
    """Tell the callgrind running this process to ``flags`` (instrumentation, dump)."""
    subprocess.run(["callgrind_control", *flags, str(os.getpid())], check=True,
                   capture_output=True)


def _count_window(run) -> None:
    """Instrument ``run()`` only, and dump its count to a file of its own."""
    _control("-i", "on")
    run()
    _control("-i", "off")
    _control("-d")


def child(workload: str, training: bool, d: int, default: bool, names_file: str) -> None:
    """Under callgrind: warm up each contender, then count its passes in a window."""
    from bench_compiled import Loop, PopLoop  # (benchmarks/bench_compiled.py)
    torch.set_num_threads(1)
    kind, batch, make_x, make_y = WORKLOADS[workload]
    torch.manual_seed(0)
    base = kind()
    made = [Loop("eager", copy.deepcopy(base), training, d),
            PopLoop("pop-eager", copy.deepcopy(base), training, d, "eager")]
    if default:
        made.append(PopLoop("pop", copy.deepcopy(base), training, d, None))
    g = torch.Generator().manual_seed(0)
    xs, ys = make_x(MICROBATCHES * batch, g), make_y(MICROBATCHES * batch, g)
    for c in made:
        c.warm_up(xs, ys, batch)
        c.round(xs, ys, batch)
    passes = PASSES.get(workload, 1)
    names = ["(empty)"]
    _count_window(lambda: None)
    for c in made:
        _count_window(lambda c=c: [c.round(xs, ys, batch) for _ in range(passes)])
        names.append(c.name if c.name != "pop" else f"pop ({c.ran()})")
    with open(names_file, "w") as f:
        json.dump(names, f)


def _totals(prefix: str) -> list[int]:
    """The instruction count of each dump ``prefix.1``, ``prefix.2``, ... in order."""
    counts = []
    k = 1
    while os.path.exists(f"{prefix}.{k}"):
        with open(f"{prefix}.{k}") as f:
            total = [int(line.split()[1]) for line in f if line.startswith("totals:")]
        counts.append(total[0] if total else 0)
        k += 1
    return counts


def measure(workload: str, training: bool, d: int, default: bool) -> dict:
    """One row: instructions per micro-batch of each contender (a callgrind child)."""
    folder = tempfile.mkdtemp(prefix="bench_instructions_")
    prefix, names_file = os.path.join(folder, "cg"), os.path.join(folder, "names.json")
    # (--fair-sched: a thread that spins while another holds valgrind's lock would
    # otherwise take its time slices)
    cmd = ["valgrind", "--tool=callgrind", "--instr-atstart=no", "--fair-sched=yes",
           f"--callgrind-out-file={prefix}", sys.executable, os.path.abspath(__file__),
           "--child", json.dumps([workload, training, d, default, names_file])]
    env = dict(os.environ, POPTORCH_LOG_LEVEL="WARN", POPTORCH_BACKEND_DECISIONS="off",
               OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1",
               PYTHONHASHSEED="0")
    env.pop("POPTORCH_BACKEND", None)
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{workload} {d}: callgrind child failed:\n{done.stderr[-2000:]}")
    with open(names_file) as f:
        names = json.load(f)
    counts = _totals(prefix)
    shutil.rmtree(folder, ignore_errors=True)
    empty = counts[0]
    per_mb = {name: (count - empty) / (MICROBATCHES * PASSES.get(workload, 1))
              for name, count in zip(names[1:], counts[1:], strict=True)}
    return {"workload": workload, "mode": "train" if training else "infer", "d": d,
            "per_microbatch": per_mb}


def report(rows: list[dict]) -> None:
    print("\nInstructions per micro-batch (callgrind; torch "
          f"{torch.__version__}, 1 thread); ratio = eager / poptorch (1.0: no overhead)")
    names = [n for n in rows[0]["per_microbatch"] if n != "eager"]
    head = f"{'workload':8s} {'mode':5s} {'d':>3s} {'eager':>12s}"
    for n in names:
        head += f" {n:>16s} {'ratio':>6s} {'+/call':>9s}"
    print(head)
    for row in rows:
        per = row["per_microbatch"]
        eager = per["eager"]
        line = f"{row['workload']:8s} {row['mode']:5s} {row['d']:3d} {eager:12,.0f}"
        for n in names:
            extra_per_call = (per[n] - eager) * row["d"]
            line += f" {per[n]:16,.0f} {eager / per[n]:6.3f} {extra_per_call:+9,.0f}"
        print(line)
    print("'+/call': the instructions poptorch adds per call (deviceIterations "
          "micro-batches), beside the eager loop's for the same micro-batches.")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="the tiny MLP only")
    parser.add_argument("--default", action="store_true",
                        help="also the default options (the automatic backend; slow)")
    parser.add_argument("--workload", choices=sorted(WORKLOADS), action="append")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(*json.loads(args.child))
        return 0
    missing = [tool for tool in ("valgrind", "callgrind_control") if shutil.which(tool) is None]
    if missing:
        print(f"bench_instructions: {', '.join(missing)} not found; install valgrind "
              "(apt install valgrind) to count instructions.")
        return 0
    workloads = args.workload or (["tiny"] if args.quick else ["tiny", "mlp"])
    jobs = [(w, training, d, args.default) for w in workloads
            for training in (False, True) for d in (1, 16)]
    # one callgrind child per row, two at a time (each child runs one thread)
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        rows = list(pool.map(lambda job: measure(*job), jobs))
    report(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
