"""The compiled device program against the loops a user would write, side by side.

For each workload (tiny MLP, MLP, CNN, small GPT), in inference and in training, with
deviceIterations 1 and 16, the same micro-batches go through:

* ``eager``: the plain PyTorch loop (per micro-batch: forward; in training zero_grad,
  forward, backward, step);
* ``compile``: the same loop over ``torch.compile(model)``;
* ``lightning`` / ``accelerate``: the loop a Lightning Fabric or an Accelerate user
  writes (``fabric.backward`` / ``accelerator.backward``), when installed
  (``pip install lightning accelerate``);
* with ``--detail``: ``pop-eager``: poptorch with ``Options.Jit.backend("eager")``, and
  ``pop-inductor``: poptorch with the ``inductor`` backend (one micro-batch and the
  update compiled, looped by the device program: ``_runtime/program/compiled_step.py``),
  forced on;
* ``pop``: poptorch with **no backend option** (the default a user gets,
  ``_runtime/program/backend_choice.py``): compiled like ``inductor``, and the model keeps
  the compiled backend only where it beats the eager one (timed over its first calls,
  counted in its compile time), in inference and in training.

Throughput is micro-batches per second, the median of interleaved rounds (noise hits
every side alike); a round times one pass of each contender over the micro-batches
(repeated for at least 0.02 s, ``--quick``, or 0.05 s), in alternating order. The
ratios that decide the targets are medians of per-round ratios: each round's pop time
against the eager loop's (and the compile loop's) of the same round, so that load
drifting over seconds on a shared machine (another process on the other core) cancels
instead of deciding a row; two copies of the same loop measured this way agree within
about 2%, where a ratio of whole-run medians of five 0.1 s rounds differed by up to 7%.
Compile time (the first calls, until the program is traced) is
reported apart and never counted in throughput. Each workload runs in a process of its
own, so compiled-code caches and thread pools do not leak between workloads.

Targets (issue 26, printed with the table): ``pop`` >= max(eager, compile) at
deviceIterations 16, and >= 0.95 x eager at deviceIterations 1 where the eager loop's
micro-batch takes >= 50 us (0.85 x below that: the tiny MLP's 25 us call). The tiny MLP's per-call host overhead is
printed in microseconds: poptorch's time per call minus the eager loop's time for the
same micro-batches.

With ``--runs N`` (issue 39) the whole benchmark runs N times in a row and keeps the
automatic backend's decisions between runs as a user's machine does (in ``--decisions
DIR``, else a fresh folder for the N runs): each run starts from the decisions the runs
before it stored, which its steady-state check confirms or corrects. Then every row's
target is ``pop`` >= 0.97 x the faster of the eager and torch.compile loops (tiny MLP:
0.85 x eager at d=1, 1.0 x at d=16), and a table of the runs ends the report with the
backend each ran. Without ``--runs`` / ``--decisions`` every run's trial decides anew
(``POPTORCH_BACKEND_DECISIONS=off``).

Run: ``python benchmarks/bench_compiled.py [--quick] [--detail] [--cold]
[--workload tiny|mlp|cnn|gpt] [--runs 3] [--decisions DIR]`` (``--detail`` adds the
``pop-eager`` and ``pop-inductor`` columns; ``--cold`` compiles with an empty inductor
cache, for first-run compile times).
About 4 minutes on a quiet 2-core machine (``--quick``: about 2).
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from workloads import WORKLOADS  # noqa: E402  (benchmarks/workloads.py)

# --------------------------------------------------------------------------- contenders


class Contender:
    """One way of running the micro-batches; ``round()`` times one pass over them."""

    def __init__(self, name, model, training, d):
        self.name, self.training, self.d = name, training, d
        self.model = model
        self.compile_seconds = 0.0

    def warm_up(self, xs, ys, batch):
        t0 = time.perf_counter()
        self.round(xs, ys, batch)
        self.compile_seconds = time.perf_counter() - t0


class Loop(Contender):
    """The hand-written loop, over the model as given (eager or torch.compile'd)."""

    def __init__(self, name, model, training, d, forward=None, opt=None, backward=None):
        super().__init__(name, model, training, d)
        self.forward = model if forward is None else forward
        if training and opt is None:
            opt = torch.optim.SGD(model.parameters(), lr=0.01)
        self.opt = opt
        # The library's backward (Fabric / Accelerate), or the loss's own.
        self.backward = backward or torch.Tensor.backward
        model.train(training)

    def round(self, xs, ys, batch):
        start = time.perf_counter()
        if self.training:
            forward, opt, backward = self.forward, self.opt, self.backward
            for x, y in zip(xs.split(batch), ys.split(batch), strict=False):
                opt.zero_grad()
                _, loss = forward(x, y)
                backward(loss)
                opt.step()
        else:
            with torch.no_grad():
                for x, y in zip(xs.split(batch), ys.split(batch), strict=False):
                    self.forward(x, y)
        return time.perf_counter() - start


class FabricLoop(Loop):
    def __init__(self, model, training, d):
        from lightning.fabric import Fabric
        fabric = Fabric(accelerator="cpu", devices=1)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        wrapped, opt = fabric.setup(model, opt) if training else (
            fabric.setup_module(model), None)
        super().__init__("lightning", model, training, d, forward=wrapped, opt=opt,
                         backward=fabric.backward)


class AccelerateLoop(Loop):
    def __init__(self, model, training, d):
        from accelerate import Accelerator
        accelerator = Accelerator(cpu=True)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        if training:
            wrapped, opt = accelerator.prepare(model, opt)
        else:
            wrapped, opt = accelerator.prepare(model), None
        super().__init__("accelerate", model, training, d, forward=wrapped, opt=opt,
                         backward=accelerator.backward)


class PopLoop(Contender):
    def __init__(self, name, model, training, d, backend):
        import poptorch
        super().__init__(name, model, training, d)
        opts = poptorch.Options().deviceIterations(d)
        opts.showCompilationProgressBar(False)
        if backend is not None:  # None: the automatic choice, as a user gets it
            opts.Jit.backend(backend)
        if training:
            self.pop = poptorch.trainingModel(
                model, opts, torch.optim.SGD(model.parameters(), lr=0.01))
        else:
            self.pop = poptorch.inferenceModel(model, opts)

    def warm_up(self, xs, ys, batch):
        t0 = time.perf_counter()
        self.round(xs, ys, batch)  # the eager first call, then compiled ones
        for _ in range(64):  # the automatic backend: until it has chosen
            if self.pop.backendInUse not in ("trial", "compiling"):
                break
            self.round(xs, ys, batch)
        self.compile_seconds = time.perf_counter() - t0

    def ran(self):
        """Which backend the calls run: "compiled" or "eager"."""
        return self.pop.backendInUse

    def round(self, xs, ys, batch):
        per_call = batch * self.d
        pop = self.pop
        start = time.perf_counter()
        for x, y in zip(xs.split(per_call), ys.split(per_call), strict=False):
            pop(x, y)
        return time.perf_counter() - start


def contenders(kind, training, d, peers, detail=False):
    torch.manual_seed(0)
    base = kind()
    made = [Loop("eager", copy.deepcopy(base), training, d)]
    compiled_model = copy.deepcopy(base)
    made.append(Loop("compile", compiled_model, training, d,
                     forward=torch.compile(compiled_model)))
    if "lightning" in peers:
        made.append(FabricLoop(copy.deepcopy(base), training, d))
    if "accelerate" in peers:
        made.append(AccelerateLoop(copy.deepcopy(base), training, d))
    if detail:
        made.append(PopLoop("pop-eager", copy.deepcopy(base), training, d, "eager"))
        made.append(PopLoop("pop-inductor", copy.deepcopy(base), training, d, "inductor"))
    made.append(PopLoop("pop", copy.deepcopy(base), training, d, None))
    return made


def available_peers():
    peers = {}
    for name, module in (("lightning", "lightning.fabric"), ("accelerate", "accelerate")):
        try:
            __import__(module)
            peers[name] = "ok"
        except Exception as error:  # report why, do not fail the benchmark
            peers[name] = f"not installed ({type(error).__name__}: {error})"
    return peers


def _timed_pass(contender, xs, ys, batch, min_seconds):
    """Seconds per pass over the micro-batches, repeating passes for at least
    ``min_seconds`` so that one scheduler time slice cannot decide a round."""
    total, passes = 0.0, 0
    while total < min_seconds:
        total += contender.round(xs, ys, batch)
        passes += 1
    return total / passes


def _paired(times, name, ref):
    """The median over rounds of ``ref``'s time / ``name``'s time in the same round:
    ``name``'s throughput relative to ``ref``. Pairing within a round cancels load that
    drifts over seconds (another process starting on the other core), which a ratio of
    medians taken over the whole run keeps."""
    return statistics.median(a / b for a, b in zip(times[ref], times[name], strict=True))


def run_workload(name, quick, detail=False):
    """Measure one workload in this process; returns a list of result rows."""
    kind, batch, make_x, make_y = WORKLOADS[name]
    peers = {k for k, v in available_peers().items() if v == "ok"}
    # Many short interleaved rounds: each ratio is the median of per-round ratios
    # (_paired), so a burst of load decides a round, never the row.
    rounds = 15 if quick else 25
    min_seconds = 0.02 if quick else 0.05
    rows = []
    for training in (False, True):
        for d in (1, 16):
            micro = 16 if quick else 32  # micro-batches per pass
            g = torch.Generator().manual_seed(0)
            xs, ys = make_x(micro * batch, g), make_y(micro * batch, g)
            runners = contenders(kind, training, d, peers, detail)
            for c in runners:
                c.warm_up(xs, ys, batch)
                c.round(xs, ys, batch)
            times = {c.name: [] for c in runners}
            for r in range(rounds):
                order = runners if r % 2 == 0 else runners[::-1]
                for c in order:
                    times[c.name].append(_timed_pass(c, xs, ys, batch, min_seconds))
            rows.append({
                "workload": name, "mode": "train" if training else "infer", "d": d,
                "pop_ran": runners[-1].ran(),
                "mb_per_s": {k: micro / statistics.median(v) for k, v in times.items()},
                "vs_eager": {k: _paired(times, k, "eager") for k in times},
                "vs_compile": {k: _paired(times, k, "compile") for k in times},
                "us_per_call": {k: statistics.median(v) / (micro / (d if k.startswith(
                    "pop") else 1)) * 1e6 for k, v in times.items()},
                "compile_s": {c.name: c.compile_seconds for c in runners
                              if c.name in ("compile", "pop-inductor", "pop")},
            })
    return rows


SHORT_CALL_US = 50.0
"""At deviceIterations 1, a workload whose eager micro-batch takes less than this many
microseconds is held to 0.85 x eager instead of 0.95 x (per-call checks dominate)."""


STORED_TARGET = 0.97
"""With decisions kept between runs: pop >= this x the faster loop (issue 39)."""


def _target(row, stored=False):
    """(ratio needed, label, against the best loop): vs eager at d=1, vs the best loop
    at d=16; with stored decisions vs the best loop everywhere (the tiny MLP's d=1
    against eager)."""
    # the tiny MLP is held to its own targets however fast the machine runs it
    short = row["workload"] == "tiny" or row["us_per_call"]["eager"] < SHORT_CALL_US
    if row["d"] == 1 and short:
        return 0.85, "0.85xE", False
    if stored:
        return (1.0, "1.0xB", True) if short else (STORED_TARGET, "0.97xB", True)
    if row["d"] != 1:
        return 1.0, "1.0xB", True
    return 0.95, "0.95xE", False


def report(rows, peers, stored=False):
    print(f"\nThroughput (micro-batches/s, median of interleaved rounds; ratios: median "
          f"of the per-round ratios), torch "
          f"{torch.__version__}, {torch.get_num_threads()} threads")
    for name, state in peers.items():
        if state != "ok":
            print(f"  {name}: {state}")
    names = list(rows[0]["mb_per_s"])
    header = f"{'workload':<9}{'mode':<6}{'d':>3}" + "".join(f"{n:>13}" for n in names)
    detail = "pop-inductor" in names
    header += (f"{'ind/eager':>10}" if detail else "") + \
        f"{'pop/eager':>10}{'pop/best':>9}{'target':>8}  ok  pop ran"
    print(header)
    failures = 0
    for row in rows:
        t = row["mb_per_s"]
        # pop against the better loop: at least each of them, round by round
        vs_eager = row["vs_eager"]["pop"]
        vs_best = min(vs_eager, row["vs_compile"]["pop"])
        need, target, best = _target(row, stored)
        ok = (vs_best if best else vs_eager) >= need
        failures += not ok
        print(f"{row['workload']:<9}{row['mode']:<6}{row['d']:>3}"
              + "".join(f"{t[n]:>13.1f}" for n in names)
              + (f"{row['vs_eager']['pop-inductor']:>10.2f}" if detail else "")
              + f"{vs_eager:>10.2f}{vs_best:>9.2f}"
              + f"{target:>8}  {'yes' if ok else 'NO ':<3} {row.get('pop_ran', '')}")
    print(f"\nTargets: pop >= max(eager, compile) at d=16 ('1.0xB'); at d=1 pop >= "
          f"0.95 x eager ('0.95xE'), 0.85 x eager where the eager micro-batch takes "
          f"< {SHORT_CALL_US:.0f} us ('0.85xE'); with stored decisions {STORED_TARGET} x "
          f"the faster loop ('0.97xB'). {len(rows) - failures} of {len(rows)} met"
          f"{'' if not failures else f', {failures} NOT met'}.")
    print("\nCompile time (s: the warm-up until compiled, one pass included; training: "
          "poptorch's first call is eager, the second compiles; pop: until the fastest "
          "backend has chosen; inductor's on-disk cache may hold earlier runs' kernels: "
          "--cold for first-run times)")
    for row in rows:
        c = row["compile_s"]
        print(f"{row['workload']:<9}{row['mode']:<6}{row['d']:>3}  torch.compile loop "
              f"{c.get('compile', 0):7.1f}   pop {c.get('pop', 0):7.1f}"
              + (f"   pop-inductor {c['pop-inductor']:7.1f}" if "pop-inductor" in c else ""))
    tiny = [r for r in rows if r["workload"] == "tiny"]
    if tiny:
        print("\nTiny MLP: microseconds per call (one call = d micro-batches for "
              "poptorch, one micro-batch for the loops); poptorch's host overhead per "
              "call = its time per call - d x the eager loop's time per micro-batch")
        for row in tiny:
            us, d = row["us_per_call"], row["d"]
            print(f"  {row['mode']:<6}d={d:<3}" + "  ".join(
                f"{k} {v:.1f}" for k, v in us.items()))
            print(f"  {'':<6}{'':<5}overhead: " + "  ".join(
                f"{k} {us[k] - d * us['eager']:+.1f} us" for k in us if k.startswith("pop")))
    return failures


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    parser.add_argument("--cold", action="store_true",
                        help="compile with an empty inductor cache (a fresh temporary "
                        "folder): compile times of a first run on a machine")
    parser.add_argument("--detail", action="store_true",
                        help="also poptorch with the eager and the inductor backend forced")
    parser.add_argument("--workload", choices=sorted(WORKLOADS), action="append",
                        help="only these workloads (default: all, one process each)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (default 1: on a shared machine, more threads "
                        "than idle cores make every side spin on its thread pool)")
    parser.add_argument("--strict", action="store_true",
                        help="exit with status 1 when a target is not met")
    parser.add_argument("--runs", type=int, default=1,
                        help="run N times in a row, the decisions kept between runs")
    parser.add_argument("--decisions", metavar="DIR",
                        help="keep the automatic backend's decisions in DIR")
    parser.add_argument("--json", help=argparse.SUPPRESS)  # child process output
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.json:
        rows = run_workload(args.workload[0], args.quick, args.detail)
        with open(args.json, "w") as f:
            json.dump(rows, f)
        return 0
    import tempfile
    stored = args.decisions or (tempfile.mkdtemp(prefix="bench_compiled_decisions_")
                                if args.runs > 1 else None)
    runs = []
    for run in range(args.runs):
        if args.runs > 1:
            print(f"\n===== run {run + 1} of {args.runs} (decisions kept in {stored})",
                  flush=True)
        rows = _measure(args, stored)
        report(rows, available_peers(), stored is not None)
        runs.append(rows)
    if args.runs > 1:
        _runs_table(runs)
    failed = any(report_failures(rows, stored is not None) for rows in runs)
    return 1 if failed and args.strict else 0


def _measure(args, stored):
    """One run: each workload in a process of its own; ``stored``: the decisions
    folder kept between runs (None: each trial decides anew)."""
    import tempfile
    rows = []
    for name in args.workload or ["tiny", "mlp", "cnn", "gpt"]:
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
            out = f.name
        cmd = [sys.executable, os.path.abspath(__file__), "--workload", name, "--json", out,
               "--threads", str(args.threads)]
        if args.quick:
            cmd.append("--quick")
        if args.detail:
            cmd.append("--detail")
        t0 = time.perf_counter()
        env = dict(os.environ, POPTORCH_LOG_LEVEL="WARN",
                   POPTORCH_BACKEND_DECISIONS=stored or "off")
        env.pop("POPTORCH_BACKEND", None)  # pop runs the default, as a user gets it
        if args.cold:
            env["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="bench_compiled_")
        subprocess.run(cmd, check=True, env=env)
        with open(out) as f:
            rows.extend(json.load(f))
        os.unlink(out)
        print(f"[{name}: measured in {time.perf_counter() - t0:.0f} s]", flush=True)
    return rows


def report_failures(rows, stored):
    """How many rows of one run miss their target (as ``report`` counts them)."""
    failures = 0
    for row in rows:
        need, _, best = _target(row, stored)
        vs_eager = row["vs_eager"]["pop"]
        got = min(vs_eager, row["vs_compile"]["pop"]) if best else vs_eager
        failures += got < need
    return failures


def _runs_table(runs):
    """pop against its target's reference in each run, and the backend it ran."""
    print("\nRuns with the decisions kept between them: pop / reference (reference: the "
          "faster loop, 'xE': the eager loop), backend pop ran")
    print(f"{'workload':<9}{'mode':<6}{'d':>3}" + "".join(
        f"{'run ' + str(i + 1):>22}" for i in range(len(runs))) + f"{'target':>8}")
    for i, row in enumerate(runs[0]):
        need, label, _ = _target(row, True)
        cells = []
        for rows in runs:
            r = rows[i]
            _, _, best = _target(r, True)
            got = min(r["vs_eager"]["pop"], r["vs_compile"]["pop"]) if best \
                else r["vs_eager"]["pop"]
            cells.append(f"{got:.2f}{'' if best else 'xE'} {r.get('pop_ran', '')}"
                         f"{'' if got >= need else ' NO'}")
        print(f"{row['workload']:<9}{row['mode']:<6}{row['d']:>3}"
              + "".join(f"{c:>22}" for c in cells) + f"{label:>8}")


if __name__ == "__main__":
    sys.exit(main())
