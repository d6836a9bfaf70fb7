"""trainingModel vs the hand-written eager training loop, side by side in one run.

Both sides train identical copies of a model on the same micro-batches with the same
optimizer. The eager loop does, per micro-batch: zero_grad, forward, backward, step.
trainingModel consumes ``deviceIterations`` micro-batches per call. Rounds alternate
between the two so that machine noise hits both alike; the median round is reported.

Run: ``python benchmarks/bench_executor.py [--quick]``.
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from workloads import CNN, MLP, Tiny  # noqa: E402  (benchmarks/workloads.py)

import poptorch  # noqa: E402

CASES = [("tiny Linear 32->10", Tiny, (32,), 16, 0.85),
         ("MLP 784-512-512-10", MLP, (784,), 64, 0.95),
         ("small CNN", CNN, (1, 28, 28), 32, 0.95)]


def make_batches(shape, batch, count, seed=0):
    g = torch.Generator().manual_seed(seed)
    xs = torch.randn(count * batch, *shape, generator=g)
    ys = torch.randint(0, 10, (count * batch,), generator=g)
    return xs, ys


def eager_round(model, opt, xs, ys, batch):
    start = time.perf_counter()
    for x, y in zip(xs.split(batch), ys.split(batch), strict=False):
        opt.zero_grad()
        _, loss = model(x, y)
        loss.backward()
        opt.step()
    return time.perf_counter() - start


def poptorch_round(pop, xs, ys, batch, d):
    start = time.perf_counter()
    for x, y in zip(xs.split(batch * d), ys.split(batch * d), strict=False):
        pop(x, y)
    return time.perf_counter() - start


def measure(kind, shape, batch, d, steps, rounds):
    torch.manual_seed(0)
    model = kind()
    eager = copy.deepcopy(model)
    eager_opt = torch.optim.SGD(eager.parameters(), lr=0.01)
    opts = poptorch.Options().deviceIterations(d)
    opts.showCompilationProgressBar(False)
    pop = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.01))
    xs, ys = make_batches(shape, batch, steps)
    eager_round(eager, eager_opt, xs, ys, batch)  # warm-up both
    poptorch_round(pop, xs, ys, batch, d)
    eager_t, pop_t = [], []
    for _ in range(rounds):
        eager_t.append(eager_round(eager, eager_opt, xs, ys, batch))
        pop_t.append(poptorch_round(pop, xs, ys, batch, d))
    e, p = statistics.median(eager_t), statistics.median(pop_t)
    return steps / e, steps / p


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    args = parser.parse_args(argv)
    torch.set_num_threads(torch.get_num_threads())
    steps = 48 if args.quick else 96
    rounds = 5 if args.quick else 11
    print(f"trainingModel vs eager loop on the CPU (torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads); steps/s, median of {rounds} rounds")
    print(f"{'model':<22}{'d':>3}{'eager':>12}{'poptorch':>12}{'ratio':>8}{'target':>8}  ok")
    failures = 0
    for name, kind, shape, batch, target in CASES:
        for d in (1, 8):
            n = steps if kind is Tiny else steps // 2
            e, p = measure(kind, shape, batch, d, n, rounds)
            goal = target if d == 1 else 1.0
            ratio = p / e
            ok = ratio >= goal
            failures += not ok
            print(f"{name:<22}{d:>3}{e:>12.1f}{p:>12.1f}{ratio:>8.2f}{goal:>8.2f}  "
                  f"{'yes' if ok else 'NO'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
