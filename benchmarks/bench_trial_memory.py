"""Live tensor memory of a first run with the default backend, against the eager one.

Issue 39 measured 168 MiB of live tensors after a cold-cache first run with default
options against 72 MiB with the eager backend (2 processes under torchrun,
8 x Linear(768, 768), AdamW). This benchmark runs that program in ``--processes``
processes (torchrun; 1: in this process's child) twice, with default options and with
``Options.Jit.backend("eager")``, each time with a fresh inductor cache
(``TORCHINDUCTOR_CACHE_DIR``) and decisions folder in a temporary directory, and reports
per process after 3 and 30 steps:

* ``live MiB``: the bytes of the distinct storages of every tensor ``gc`` finds
  (views and aliases counted once; fake and meta tensors hold no memory and are not
  counted) -- the target: default <= 1.25 x eager at both points;
* ``fake``: how many fake tensors (compile-time stand-ins held by torch.compile's
  graphs and guards) are alive, and the bytes they would take if real: a count of
  ``gc``'s tensors that sums ``nbytes`` without looking at the storage counts these too.

Run: ``python benchmarks/bench_trial_memory.py [--processes 2] [--steps 30]
[--compile-backend inductor|aot_eager]`` (inductor compiles for minutes on a loaded
2-core machine; ``aot_eager`` captures the same graphs without code generation).
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import subprocess
import sys
import tempfile

MIB = 2 ** 20


def live_tensors() -> dict[str, float]:
    """Distinct storage bytes of the live real tensors, and the fake tensors' count and
    nominal bytes (MiB)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensor

    gc.collect()
    storages: dict[tuple[int, int], int] = {}
    fakes, fake_bytes = 0, 0
    for obj in gc.get_objects():
        try:
            if not isinstance(obj, torch.Tensor):
                continue
        except ReferenceError:
            continue
        if isinstance(obj, FakeTensor) or obj.device.type == "meta":
            fakes += 1
            with contextlib.suppress(RuntimeError):
                if not any(isinstance(n, torch.SymInt) for n in obj.shape):
                    fake_bytes += int(obj.numel()) * obj.element_size()
            continue  # (symbolic sizes: counted, their bytes not)
        try:
            storage = obj.untyped_storage()
        except (RuntimeError, NotImplementedError):  # e.g. sparse, functional wrappers
            continue
        if storage.data_ptr():
            storages[(storage.data_ptr(), storage.nbytes())] = storage.nbytes()
    return {"live_mib": sum(storages.values()) / MIB, "fakes": float(fakes),
            "fake_mib": fake_bytes / MIB}


def worker(backend: str, steps: int, out: str) -> None:
    """One process of the program; writes its measurements to ``out``.<rank>.json."""
    import torch
    from torch import nn

    import poptorch

    rank = int(os.environ.get("RANK", "0"))
    torch.manual_seed(0)
    layers = [m for _ in range(8) for m in (nn.Linear(768, 768), nn.ReLU())]

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(*layers)

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple:
            out = self.net(x)
            return out, nn.functional.mse_loss(out, y)

    model = Model()
    opts = poptorch.Options()
    opts.showCompilationProgressBar(False)
    if backend == "eager":
        opts.Jit.backend("eager")
    training = poptorch.trainingModel(model, opts,
                                      torch.optim.AdamW(model.parameters(), lr=1e-4))
    g = torch.Generator().manual_seed(rank)
    result: dict[str, object] = {"backend": backend}
    for step in range(1, steps + 1):
        training(torch.randn(16, 768, generator=g), torch.randn(16, 768, generator=g))
        if step in (3, steps):
            result[str(step)] = live_tensors()
            result[f"backend_{step}"] = training.backendInUse
    with open(f"{out}.{rank}.json", "w", encoding="utf-8") as f:
        json.dump(result, f)


def run(backend: str, processes: int, steps: int, compile_backend: str) -> list[dict]:
    """The program with ``backend`` ("default" or "eager") in fresh caches."""
    with tempfile.TemporaryDirectory(prefix="bench_trial_memory_") as tmp:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=os.path.join(tmp, "inductor"),
                   POPTORCH_BACKEND_DECISIONS=os.path.join(tmp, "decisions"),
                   POPTORCH_TORCH_COMPILE_BACKEND=compile_backend,
                   POPTORCH_LOG_LEVEL="WARN", OMP_NUM_THREADS="1")
        env.pop("POPTORCH_BACKEND", None)
        out = os.path.join(tmp, "result")
        args = [__file__, "--worker", backend, "--steps", str(steps), "--out", out]
        if processes > 1:
            command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                       f"--nproc_per_node={processes}", *args]
        else:
            command = [sys.executable, *args]
        subprocess.run(command, env=env, check=True)
        results = []
        for rank in range(processes):
            with open(f"{out}.{rank}.json", encoding="utf-8") as f:
                results.append(json.load(f))
        return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--compile-backend", default="inductor")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker, args.steps, args.out)
        return 0
    measured = {b: run(b, args.processes, args.steps, args.compile_backend)
                for b in ("default", "eager")}
    print(f"live tensors per process ({args.processes} processes, fresh caches, "
          f"torch.compile backend {args.compile_backend}); target default <= 1.25 x eager")
    print(f"{'rank':>4} {'step':>5} {'default MiB':>12} {'eager MiB':>10} {'ratio':>6} "
          f"{'backend':>9} {'fakes':>6} {'fake MiB':>9}")
    ok = True
    for rank in range(args.processes):
        for step in ("3", str(args.steps)):
            d, e = measured["default"][rank][step], measured["eager"][rank][step]
            ratio = d["live_mib"] / e["live_mib"]
            ok &= ratio <= 1.25
            print(f"{rank:>4} {step:>5} {d['live_mib']:>12.1f} {e['live_mib']:>10.1f} "
                  f"{ratio:>5.2f}x {measured['default'][rank]['backend_' + step]:>9} "
                  f"{int(d['fakes']):>6} {d['fake_mib']:>9.1f}")
    print("target met" if ok else "TARGET MISSED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
