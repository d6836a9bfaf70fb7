"""The compiled device program against the loops a user would write, side by side.

For each workload (tiny MLP, MLP, CNN, small GPT), in inference and in training, with
deviceIterations 1 and 16, the same micro-batches go through:

* ``eager``: the plain PyTorch loop (per micro-batch: forward; in training zero_grad,
  forward, backward, step);
* ``compile``: the same loop over ``torch.compile(model)``;
* ``lightning`` / ``accelerate``: the loop a Lightning Fabric or an Accelerate user
  writes (``fabric.backward`` / ``accelerator.backward``), when installed
  (``pip install lightning accelerate``);
* ``pop-eager``: poptorch with ``Options.Jit.backend("eager")``;
* ``pop``: poptorch with the ``inductor`` backend (the whole call compiled,
  ``_runtime/compiled_step.py``).

Throughput is micro-batches per second, the median of interleaved rounds (noise hits
every side alike); a round repeats passes over the micro-batches for at least 0.2 s
(``--quick``) or 0.5 s. Compile time (the first calls, until the program is traced) is
reported apart and never counted in throughput. Each workload runs in a process of its
own, so compiled-code caches and thread pools do not leak between workloads.

Targets (issue 14): ``pop`` >= 0.95 x eager at deviceIterations 1 and
>= max(eager, compile) at deviceIterations 16.

Run: ``python benchmarks/bench_compiled.py [--quick] [--workload tiny|mlp|cnn|gpt]``.
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
import torch.nn as nn
import torch.nn.functional as F

# --------------------------------------------------------------------------- workloads


class TinyMLP(nn.Module):
    """Overhead-bound: 32-32-10."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(32, 32), nn.Linear(32, 10)

    def forward(self, x, y):
        out = self.fc2(F.relu(self.fc1(x)))
        return out, F.cross_entropy(out, y)


class MLP(nn.Module):
    """784-512-512-10."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512),
                                 nn.ReLU(), nn.Linear(512, 10))

    def forward(self, x, y):
        out = self.net(x)
        return out, F.cross_entropy(out, y)


class CNN(nn.Module):
    """Small CNN on 1x28x28 images."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc = nn.Linear(32 * 7 * 7, 10)

    def forward(self, x, y):
        h = F.max_pool2d(F.relu(self.conv1(x)), 2)
        h = F.max_pool2d(F.relu(self.conv2(h)), 2)
        out = self.fc(h.flatten(1))
        return out, F.cross_entropy(out, y)


class GPT(nn.Module):
    """Small causal transformer: 2 layers, width 64, 4 heads, context 32, vocab 128."""

    def __init__(self, vocab=128, width=64, heads=4, layers=2, context=32):
        super().__init__()
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Parameter(torch.zeros(context, width))
        self.layers = nn.ModuleList(_Layer(width, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)

    def forward(self, x, y):
        h = self.tok(x) + self.pos[:x.shape[1]]
        for layer in self.layers:
            h = layer(h)
        logits = self.head(self.norm(h))
        return logits, F.cross_entropy(logits.flatten(0, 1), y.flatten())


class _Layer(nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(),
                                 nn.Linear(4 * width, width))

    def forward(self, h):
        b, t, c = h.shape
        q, k, v = self.qkv(self.norm1(h)).view(b, t, 3, self.heads, c // self.heads) \
            .permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = h + self.proj(a.transpose(1, 2).reshape(b, t, c))
        return h + self.mlp(self.norm2(h))


def _images(n, g):
    return torch.randn(n, 1, 28, 28, generator=g)


WORKLOADS = {
    # name: (model class, micro-batch, make x(n, generator), make y(n, generator))
    "tiny": (TinyMLP, 16, lambda n, g: torch.randn(n, 32, generator=g),
             lambda n, g: torch.randint(0, 10, (n,), generator=g)),
    "mlp": (MLP, 64, lambda n, g: torch.randn(n, 784, generator=g),
            lambda n, g: torch.randint(0, 10, (n,), generator=g)),
    "cnn": (CNN, 32, _images, lambda n, g: torch.randint(0, 10, (n,), generator=g)),
    "gpt": (GPT, 8, lambda n, g: torch.randint(0, 128, (n, 32), generator=g),
            lambda n, g: torch.randint(0, 128, (n, 32), generator=g)),
}

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

    def __init__(self, name, model, training, d, forward=None):
        super().__init__(name, model, training, d)
        self.forward = model if forward is None else forward
        self.opt = torch.optim.SGD(model.parameters(), lr=0.01) if training else None
        model.train(training)

    def round(self, xs, ys, batch):
        start = time.perf_counter()
        if self.training:
            forward, opt = self.forward, self.opt
            for x, y in zip(xs.split(batch), ys.split(batch)):
                opt.zero_grad()
                _, loss = forward(x, y)
                loss.backward()
                opt.step()
        else:
            with torch.no_grad():
                for x, y in zip(xs.split(batch), ys.split(batch)):
                    self.forward(x, y)
        return time.perf_counter() - start


class FabricLoop(Loop):
    def __init__(self, model, training, d):
        from lightning.fabric import Fabric
        fabric = Fabric(accelerator="cpu", devices=1)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        wrapped, self._opt = fabric.setup(model, opt) if training else (
            fabric.setup_module(model), None)
        self.fabric = fabric
        super().__init__("lightning", model, training, d, forward=wrapped)
        self.opt = self._opt

    def round(self, xs, ys, batch):
        if not self.training:
            return super().round(xs, ys, batch)
        start = time.perf_counter()
        for x, y in zip(xs.split(batch), ys.split(batch)):
            self.opt.zero_grad()
            _, loss = self.forward(x, y)
            self.fabric.backward(loss)
            self.opt.step()
        return time.perf_counter() - start


class AccelerateLoop(Loop):
    def __init__(self, model, training, d):
        from accelerate import Accelerator
        accelerator = Accelerator(cpu=True)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        if training:
            wrapped, opt = accelerator.prepare(model, opt)
        else:
            wrapped, opt = accelerator.prepare(model), None
        self.accelerator = accelerator
        super().__init__("accelerate", model, training, d, forward=wrapped)
        self.opt = opt

    def round(self, xs, ys, batch):
        if not self.training:
            return super().round(xs, ys, batch)
        start = time.perf_counter()
        for x, y in zip(xs.split(batch), ys.split(batch)):
            self.opt.zero_grad()
            _, loss = self.forward(x, y)
            self.accelerator.backward(loss)
            self.opt.step()
        return time.perf_counter() - start


class PopLoop(Contender):
    def __init__(self, name, model, training, d, backend):
        import poptorch
        super().__init__(name, model, training, d)
        opts = poptorch.Options().deviceIterations(d)
        opts.showCompilationProgressBar(False)
        opts.Jit.backend(backend)
        if training:
            self.pop = poptorch.trainingModel(
                model, opts, torch.optim.SGD(model.parameters(), lr=0.01))
        else:
            self.pop = poptorch.inferenceModel(model, opts)

    def warm_up(self, xs, ys, batch):
        t0 = time.perf_counter()
        self.round(xs, ys, batch)  # training: eager first call, then compiled ones
        self.compile_seconds = time.perf_counter() - t0

    def round(self, xs, ys, batch):
        per_call = batch * self.d
        pop = self.pop
        start = time.perf_counter()
        for x, y in zip(xs.split(per_call), ys.split(per_call)):
            pop(x, y)
        return time.perf_counter() - start


def contenders(kind, training, d, peers):
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
    made.append(PopLoop("pop-eager", copy.deepcopy(base), training, d, "eager"))
    made.append(PopLoop("pop", copy.deepcopy(base), training, d, "inductor"))
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


def run_workload(name, quick):
    """Measure one workload in this process; returns a list of result rows."""
    kind, batch, make_x, make_y = WORKLOADS[name]
    peers = {k for k, v in available_peers().items() if v == "ok"}
    rounds = 5 if quick else 9
    min_seconds = 0.2 if quick else 0.5
    rows = []
    for training in (False, True):
        for d in (1, 16):
            micro = 32 if quick else 64  # micro-batches per round
            g = torch.Generator().manual_seed(0)
            xs, ys = make_x(micro * batch, g), make_y(micro * batch, g)
            runners = contenders(kind, training, d, peers)
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
                "mb_per_s": {k: micro / statistics.median(v) for k, v in times.items()},
                "us_per_call": {k: statistics.median(v) / (micro / (d if k.startswith(
                    "pop") else 1)) * 1e6 for k, v in times.items()},
                "compile_s": {c.name: c.compile_seconds for c in runners
                              if c.name in ("compile", "pop")},
            })
    return rows


def report(rows, peers):
    print(f"\nThroughput (micro-batches/s, median of interleaved rounds), torch "
          f"{torch.__version__}, {torch.get_num_threads()} threads")
    for name, state in peers.items():
        if state != "ok":
            print(f"  {name}: {state}")
    names = list(rows[0]["mb_per_s"])
    header = f"{'workload':<6}{'mode':<6}{'d':>3}" + "".join(f"{n:>12}" for n in names)
    header += f"{'pop/eager':>10}{'pop/best':>10}{'target':>8}  ok"
    print(header)
    failures = 0
    for row in rows:
        t = row["mb_per_s"]
        best = max(t["eager"], t["compile"])
        vs_eager, vs_best = t["pop"] / t["eager"], t["pop"] / best
        ok = vs_eager >= 0.95 if row["d"] == 1 else vs_best >= 1.0
        target = "0.95xE" if row["d"] == 1 else "1.0xB"
        failures += not ok
        print(f"{row['workload']:<6}{row['mode']:<6}{row['d']:>3}"
              + "".join(f"{t[n]:>12.1f}" for n in names)
              + f"{vs_eager:>10.2f}{vs_best:>10.2f}{target:>8}  {'yes' if ok else 'NO'}")
    print("\nCompile time (s, first round incl. one pass; training: poptorch's first "
          "call is eager, the second compiles)")
    for row in rows:
        c = row["compile_s"]
        print(f"{row['workload']:<6}{row['mode']:<6}{row['d']:>3}  torch.compile loop "
              f"{c.get('compile', 0):7.1f}   poptorch {c.get('pop', 0):7.1f}")
    tiny = [r for r in rows if r["workload"] == "tiny"]
    if tiny:
        print("\nTiny MLP: microseconds per call (one call = d micro-batches for "
              "poptorch, one micro-batch for the loops)")
        for row in tiny:
            print(f"  {row['mode']:<6}d={row['d']:<3}" + "  ".join(
                f"{k} {v:.0f}" for k, v in row["us_per_call"].items()))
    return failures


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    parser.add_argument("--workload", choices=sorted(WORKLOADS), action="append",
                        help="only these workloads (default: all, one process each)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (default 1: on a shared machine, more threads "
                        "than idle cores make every side spin on its thread pool)")
    parser.add_argument("--json", help=argparse.SUPPRESS)  # child process output
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.json:
        rows = run_workload(args.workload[0], args.quick)
        with open(args.json, "w") as f:
            json.dump(rows, f)
        return 0
    rows = []
    import tempfile
    for name in args.workload or ["tiny", "mlp", "cnn", "gpt"]:
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
            out = f.name
        cmd = [sys.executable, os.path.abspath(__file__), "--workload", name, "--json", out,
               "--threads", str(args.threads)]
        if args.quick:
            cmd.append("--quick")
        t0 = time.perf_counter()
        env = dict(os.environ, POPTORCH_LOG_LEVEL="WARN")
        subprocess.run(cmd, check=True, env=env)
        with open(out) as f:
            rows.extend(json.load(f))
        os.unlink(out)
        print(f"[{name}: measured in {time.perf_counter() - t0:.0f} s]", flush=True)
    report(rows, available_peers())
    return 0


if __name__ == "__main__":
    sys.exit(main())
