"""The least an inference call of a PopTorch model can cost, measured against the eager
loop: poptorch's settled call beside hand-written wrappers that do only what such a
call must do.

``bench_compiled.py`` holds poptorch's inference calls to targets against the eager loop
(the tiny MLP: 0.85 x at deviceIterations 1, 1.0 x at 16). This benchmark shows how
much of that ratio any runtime can keep on the machine it runs on. The same
micro-batches (inference, one thread) go through:

* ``eager``: the plain loop, ``with torch.no_grad(): model(x, y)`` per micro-batch;
* ``bare``: one Python call per call that switches gradients off, runs the model on each
  micro-batch of the call and switches them back (a wrapper that does nothing else);
* ``floor``: ``bare`` plus what every PopTorch inference call does, whatever the runtime
  behind it: the inputs checked against the compiled ones (dynamo's C++ tensor guard,
  as poptorch's settled call does), every module checked to be in eval mode, the call
  timed for the perf counters, with d > 1 the inputs split into micro-batches and the
  outputs of the call's micro-batches combined (``torch.cat`` of the outputs,
  ``torch.stack`` of the losses: ``OutputMode.All``), and ``backward()`` refused on
  each output tensor;
* ``pop``: ``poptorch.inferenceModel`` with the eager backend (what the automatic
  choice runs for these rows), settled on its per-call fast path.

Each contender's outputs are checked against the eager model's before timing. Ratios are
medians of per-round paired ratios against the eager loop (interleaved rounds, as in
``bench_compiled.py``); ``+us/call`` is the time per call over d eager micro-batches.

Run: ``python benchmarks/bench_call_floor.py [--quick] [--workload tiny|mlp]``
(about 1 minute; ``--quick``: 20 s).
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
from workloads import WORKLOADS

_set_grad = torch._C._set_grad_enabled


def _refused(*_args, **_kwargs):
    raise RuntimeError("backward() cannot be called explicitly on outputs of a PopTorch "
                       "model")


def microbatches(x, y, d):
    """The ``d`` micro-batches of one call's inputs (views along dimension 0)."""
    n = x.shape[0] // d
    return zip(x.split(n), y.split(n), strict=True)


class Bare:
    """Gradients off, the model on each micro-batch, gradients on: nothing else."""

    def __init__(self, model, d):
        self.model, self.d = model, d

    def __call__(self, x, y):
        model = self.model
        _set_grad(False)
        try:
            if self.d == 1:
                return model(x, y)
            return [model(a, b) for a, b in microbatches(x, y, self.d)]
        finally:
            _set_grad(True)


class Floor:
    """What every PopTorch inference call does around the model (module docstring)."""

    def __init__(self, model, d, x, y):
        from poptorch._runtime.torch_internals import tensor_inputs_check
        self.model, self.d = model, d
        self.check = tensor_inputs_check((x, y))
        self.modules = list(model.modules())
        self.seconds = 0.0

    def __call__(self, x, y):
        if not self.check(x, y):
            raise ValueError("inputs unlike the compiled ones")
        for module in self.modules:
            if module.training:
                raise ValueError("a module left in training mode")
        model, d = self.model, self.d
        start = time.perf_counter()
        _set_grad(False)
        try:
            if d == 1:
                outputs = model(x, y)
            else:
                parts = [model(a, b) for a, b in microbatches(x, y, d)]
                outs, losses = zip(*parts, strict=True)
                outputs = (torch.cat(outs), torch.stack(losses))
        finally:
            _set_grad(True)
        self.seconds += time.perf_counter() - start
        for tensor in outputs:
            tensor.backward = _refused
        return outputs


def contenders(name, d, x, y):
    """The eager model and the wrappers of one workload (module docstring), each over its
    own copy of the same weights (as ``bench_compiled.py``'s contenders)."""
    import poptorch
    torch.manual_seed(0)
    base = WORKLOADS[name][0]().eval()
    opts = poptorch.Options().deviceIterations(d)
    opts.Jit.backend("eager")
    opts.showCompilationProgressBar(False)
    return base, {"bare": Bare(copy.deepcopy(base), d),
                  "floor": Floor(copy.deepcopy(base), d, x, y),
                  "pop": poptorch.inferenceModel(copy.deepcopy(base), opts)}


def check_outputs(base, wrappers, x, y, d):
    """The floor's and poptorch's outputs of one call equal the eager model's on the
    same micro-batches (outputs concatenated, losses stacked: ``OutputMode.All``)."""
    with torch.no_grad():
        parts = [base(a, b) for a, b in microbatches(x, y, d)]
    expected = (torch.cat([p[0] for p in parts]), torch.stack([p[1] for p in parts])) \
        if d > 1 else parts[0]
    for name in ("floor", "pop"):
        out = wrappers[name](x, y)
        for got, want in zip(out, expected, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6,
                                       msg=lambda m, n=name: f"{n}: {m}")


def measure(name, d, rounds, min_seconds, calls=16):
    """Seconds per pass of ``calls`` calls for each contender, one list per contender."""
    _, batch, make_x, make_y = WORKLOADS[name]
    g = torch.Generator().manual_seed(0)
    xs, ys = make_x(calls * d * batch, g), make_y(calls * d * batch, g)
    base, wrappers = contenders(name, d, xs[:d * batch], ys[:d * batch])
    check_outputs(base, wrappers, xs[:d * batch], ys[:d * batch], d)
    eager_model = copy.deepcopy(base)

    # Each pass splits the inputs as it goes, as a user's loop over a loader's batches
    # does: the eager loop into micro-batches, the wrappers into calls of d of them.
    def eager():
        start = time.perf_counter()
        with torch.no_grad():
            for x, y in zip(xs.split(batch), ys.split(batch), strict=True):
                eager_model(x, y)
        return time.perf_counter() - start

    def looped(wrapper):
        def run():
            start = time.perf_counter()
            for x, y in zip(xs.split(d * batch), ys.split(d * batch), strict=True):
                wrapper(x, y)
            return time.perf_counter() - start
        return run

    runs = {"eager": eager, **{k: looped(w) for k, w in wrappers.items()}}
    for run in runs.values():  # warm up (poptorch settles its fast path)
        for _ in range(3):
            run()
    times = {k: [] for k in runs}
    for r in range(rounds):
        order = list(runs.items())
        for k, run in order if r % 2 == 0 else order[::-1]:
            total, passes = 0.0, 0
            while total < min_seconds:
                total += run()
                passes += 1
            times[k].append(total / passes)
    return times, calls


def report(name, d, times, calls):
    eager = times["eager"]
    eager_us = statistics.median(eager) / calls * 1e6
    for k, v in times.items():
        ratio = statistics.median(a / b for a, b in zip(eager, v, strict=True))
        us = statistics.median(v) / calls * 1e6
        print(f"{name:<6}{d:>4}  {k:<7}{us:>10.1f}{ratio:>9.3f}{us - eager_us:>+11.1f}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--workload", action="append", choices=("tiny", "mlp"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rounds, min_seconds = (11, 0.02) if args.quick else (25, 0.05)
    print(f"torch {torch.__version__}, 1 thread; inference; ratio: the eager loop's time "
          f"/ the contender's (median of {rounds} paired rounds)")
    print(f"{'model':<6}{'d':>4}  {'':<7}{'us/call':>10}{'ratio':>9}{'+us/call':>11}")
    for name in args.workload or ["tiny", "mlp"]:
        for d in (1, 16):
            report(name, d, *measure(name, d, rounds, min_seconds))


if __name__ == "__main__":
    main()
