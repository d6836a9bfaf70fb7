"""The GPU benchmarks of ``benchmarks/gpu_check.sh``, written as Markdown sections.

On one GPU (``cuda:0``), for the MLP, CNN and small GPT of ``workloads.py``, training and
inference at deviceIterations 16, the same micro-batches go through:

* ``eager``: the plain PyTorch loop (per micro-batch forward; training: zero_grad,
  forward, backward, step);
* ``compile``: the same loop over ``torch.compile(model)``;
* ``pop``: poptorch with no backend option (the default: the compiled backend where its
  first calls measure it faster than the eager one; each call replayed as one CUDA graph
  where it can be);
* ``pop-graph``: poptorch's eager backend, each call replayed as one CUDA graph
  (``_runtime/program/cuda_graphs.py``).

Each is timed with ``torch.utils.benchmark.Timer`` (which synchronises the GPU around
every measurement), after a warm-up that includes compiling; compile times are reported
apart. Then GPT-2 small (124M-parameter layout, context 1024) trains in bfloat16:
tokens/s and model FLOPs utilisation (MFU: 6 x parameters + 12 x layers x context x
width FLOPs per token, over the GPU's dense bf16 peak) for the eager loop and poptorch.
``--ddp`` runs under torchrun: poptorch against DistributedDataParallel with NCCL on
the GPUs present.

Sizes (``--size``): ``default``; ``quick`` (``gpu_check.sh --quick``: the MLP only, a
4-layer GPT-2 at context 256, shorter timings); ``smoke`` (``--device cpu --smoke``: the
same code on the CPU with tiny sizes, a test of the script itself, tests/test_gpu_check.py;
its numbers mean nothing). Rows are written to ``--output`` as they are measured, and
``--progress FILE`` gets ``plan ROW`` for every row a section will measure and ``done
ROW`` after each, so that ``gpu_check.sh`` can list what a section stopped at its time
budget did not measure. The torchrun section needs 2 GPUs and says so with fewer.
"""
from __future__ import annotations

import argparse
import copy
import os
import signal
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from workloads import GPT, WORKLOADS  # noqa: E402

PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "GH200": 989e12, "A100": 312e12,
             "L40S": 362e12, "L4": 121e12, "A10": 125e12, "B200": 2250e12}
"""Dense bf16 tensor-core peaks (FLOP/s) by device name, for MFU; SXM parts."""


def _compile_backend() -> str:
    """torch.compile's backend for the compile loop: poptorch's own setting
    (``POPTORCH_TORCH_COMPILE_BACKEND``, inductor unless set), so both compile alike."""
    return os.environ.get("POPTORCH_TORCH_COMPILE_BACKEND", "inductor")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key in sorted(PEAK_BF16, key=len, reverse=True):
        if key in name:
            return PEAK_BF16[key]
    return None


class Report:
    """The Markdown lines, written to the output file as they come (a section stopped
    at its time budget keeps what it measured), and the rows' progress."""

    def __init__(self, path: str | None, progress: str | None) -> None:
        self.path, self.progress = path, progress
        self.lines: list[str] = []

    def append(self, line: str) -> None:
        self.lines.append(line)
        if self.path:
            with open(self.path, "a") as f:
                f.write(line + "\n")

    def mark(self, word: str, row: str) -> None:
        if self.progress:
            with open(self.progress, "a") as f:
                f.write(f"{word} {row}\n")


# --------------------------------------------------------------------------- contenders

class Loop:
    """The hand-written loop, over the model as given (eager or torch.compile'd)."""

    def __init__(self, model, forward, training, device):
        self.model, self.training = model, training
        self.forward = model if forward is None else forward
        self.opt = torch.optim.SGD(model.parameters(), lr=0.01) if training else None

    def __call__(self, xs, ys, batch, d):
        if self.training:
            for x, y in zip(xs.split(batch), ys.split(batch), strict=False):
                self.opt.zero_grad()
                _, loss = self.forward(x, y)
                loss.backward()
                self.opt.step()
        else:
            with torch.no_grad():
                for x, y in zip(xs.split(batch), ys.split(batch), strict=False):
                    self.forward(x, y)


class Pop:
    """A poptorch model: ``backend`` None is the default a user gets."""

    def __init__(self, model, training, d, backend):
        import poptorch
        opts = poptorch.Options().deviceIterations(d)
        opts.showCompilationProgressBar(False)
        if backend is not None:
            opts.Jit.backend(backend)
        self.pop = poptorch.trainingModel(
            model, opts, torch.optim.SGD(model.parameters(), lr=0.01)) if training \
            else poptorch.inferenceModel(model, opts)

    def __call__(self, xs, ys, batch, d):
        per_call = batch * d
        for x, y in zip(xs.split(per_call), ys.split(per_call), strict=False):
            self.pop(x, y)

    def path(self) -> str:
        program = self.pop._program  # (None before compiling)
        if program is None:
            return "not compiled"
        graphs = program._graphs
        replayed = graphs is not None and graphs.replays > 0
        return f"{self.pop.backendInUse}{' + CUDA graph' if replayed else ''}"


def _warm(fn, xs, ys, batch, d, device, calls):
    t0 = time.perf_counter()
    for _ in range(calls):
        fn(xs, ys, batch, d)
    sync(device)
    return time.perf_counter() - t0


def _timed(fn, xs, ys, batch, d, min_seconds):
    from torch.utils.benchmark import Timer
    timer = Timer(stmt="fn(xs, ys, batch, d)",
                  globals={"fn": fn, "xs": xs, "ys": ys, "batch": batch, "d": d})
    return timer.blocked_autorange(min_run_time=min_seconds).median


def workloads_section(device, names, d, micro, min_seconds, out):
    out.append(f"## Throughput on {device_name(device)} (micro-batches/s, deviceIterations "
               f"{d}; torch.utils.benchmark medians, GPU synchronised)\n")
    out.append("| workload | mode | eager | compile | pop (default) | pop-graph | "
               "pop/eager | pop/best loop | pop-graph/eager | pop ran | compile s (compile / pop) |")
    out.append("|---|---|---|---|---|---|---|---|---|---|---|")
    for name in names:
        for training in (False, True):
            out.mark("plan", f"{name} {'train' if training else 'infer'}")
    for name in names:
        kind, batch, make_x, make_y = WORKLOADS[name]
        g = torch.Generator().manual_seed(0)
        n = micro * batch
        xs_cpu, ys_cpu = make_x(n, g), make_y(n, g)
        xs, ys = xs_cpu.to(device), ys_cpu.to(device)
        for training in (False, True):
            try:
                torch.manual_seed(0)
                base = kind().to(device)
                base.train(training)
                compiled_model = copy.deepcopy(base)
                runners = {
                    "eager": (Loop(copy.deepcopy(base), None, training, device), xs, ys),
                    "compile": (Loop(compiled_model, torch.compile(
                        compiled_model, backend=_compile_backend()), training, device),
                        xs, ys),
                    # poptorch takes host tensors, as a PopTorch program passes them
                    "pop": (Pop(copy.deepcopy(base).cpu(), training, d, None), xs_cpu,
                            ys_cpu),
                    "pop-graph": (Pop(copy.deepcopy(base).cpu(), training, d, "eager"),
                                  xs_cpu, ys_cpu),
                }
                warm = {}
                for key, (fn, a, b) in runners.items():
                    warm[key] = _warm(fn, a, b, batch, d, device, 3 if key != "pop" else 24)
                rate = {key: micro / _timed(fn, a, b, batch, d, min_seconds)
                        for key, (fn, a, b) in runners.items()}
                best = max(rate["eager"], rate["compile"])
                out.append(
                    f"| {name} | {'train' if training else 'infer'} | "
                    + " | ".join(f"{rate[k]:.0f}" for k in
                                 ("eager", "compile", "pop", "pop-graph"))
                    + f" | {rate['pop'] / rate['eager']:.2f} | {rate['pop'] / best:.2f} | "
                    f"{rate['pop-graph'] / rate['eager']:.2f} | "
                    f"{runners['pop'][0].path()} / {runners['pop-graph'][0].path()} | "
                    f"{warm['compile']:.1f} / {warm['pop']:.1f} |")
            except Exception as error:  # noqa: BLE001  (one failing row must not lose the report)
                out.append(f"| {name} | {'train' if training else 'infer'} | failed: "
                           f"{type(error).__name__}: {str(error).splitlines()[0][:150]} "
                           "| | | | | | | | |")
                traceback.print_exc()
            out.mark("done", f"{name} {'train' if training else 'infer'}")
    out.append("")


def device_name(device):
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "the CPU"


def gpt2_section(device, size, out):
    """GPT-2 small in bfloat16: tokens/s and MFU, eager loop vs poptorch default."""
    if size == "smoke":
        cfg = {"vocab": 128, "width": 32, "heads": 2, "layers": 1, "context": 16}
        batch, d, steps = 2, 2, 2
    elif size == "quick":
        cfg = {"vocab": 50257, "width": 768, "heads": 12, "layers": 4, "context": 256}
        batch, d, steps = 8, 2, 4
    else:
        cfg = {"vocab": 50257, "width": 768, "heads": 12, "layers": 12, "context": 1024}
        batch, d, steps = 8, 4, 8
    out.append(f"## GPT-2 small, bfloat16 training ({cfg['layers']} layers, width "
               f"{cfg['width']}, context {cfg['context']}, micro-batch {batch})\n")
    try:
        torch.manual_seed(0)
        base = GPT(**cfg).to(torch.bfloat16)
        params = sum(p.numel() for p in base.parameters())
        t = cfg["context"]
        flops_per_token = 6 * params + 12 * cfg["layers"] * t * cfg["width"]
        n = batch * d * steps
        g = torch.Generator().manual_seed(0)
        x = torch.randint(0, cfg["vocab"], (n, t), generator=g)
        y = torch.randint(0, cfg["vocab"], (n, t), generator=g)
        peak = peak_flops(device)
        out.append(f"{params / 1e6:.0f}M parameters; {flops_per_token / 1e9:.2f} GFLOP per "
                   f"token; peak {'unknown' if peak is None else f'{peak / 1e12:.0f} TFLOP/s'}"
                   "\n")
        out.append("| contender | tokens/s | MFU | warm-up s |")
        out.append("|---|---|---|---|")
        model = copy.deepcopy(base).to(device)
        loop = Loop(model, model, True, device)
        loop.opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        xd, yd = x.to(device), y.to(device)
        rows = {"eager loop (AdamW)": (loop, xd, yd)}
        import poptorch
        opts = poptorch.Options().deviceIterations(d)
        opts.showCompilationProgressBar(False)
        pop_model = copy.deepcopy(base)
        pop = poptorch.trainingModel(pop_model, opts, torch.optim.AdamW(
            pop_model.parameters(), lr=1e-4, capturable=device.type == "cuda"))

        def pop_run(xs, ys, b, dd):
            for xc, yc in zip(xs.split(b * dd), ys.split(b * dd), strict=False):
                pop(xc, yc)
        rows["poptorch default (AdamW)"] = (pop_run, x, y)
        for name in rows:
            out.mark("plan", f"gpt2 {name}")
        for name, (fn, a, b) in rows.items():
            warm = _warm(fn, a, b, batch, d, device, 3 if "eager" in name else 24)
            t0 = time.perf_counter()
            fn(a, b, batch, d)
            sync(device)
            seconds = time.perf_counter() - t0
            tokens = n * t / seconds
            mfu = "n/a" if peak is None else f"{tokens * flops_per_token / peak:.1%}"
            out.append(f"| {name} | {tokens:,.0f} | {mfu} | {warm:.1f} |")
            out.mark("done", f"gpt2 {name}")
    except Exception as error:  # noqa: BLE001  (a failing section must not lose the report)
        out.append(f"failed: {type(error).__name__}: {str(error).splitlines()[0][:300]}")
        traceback.print_exc()
    out.append("")


# --------------------------------------------------------------------------- DDP

def ddp_worker(result_path: str, smoke: bool) -> None:
    """Under torchrun: poptorch's trainingModel vs DDP + a plain loop, NCCL on GPUs."""
    import statistics

    import torch.distributed as dist

    import poptorch
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    kind, batch, make_x, make_y = WORKLOADS["cnn"]
    d, calls = (2, 2) if smoke else (8, 8)
    g = torch.Generator().manual_seed(rank)
    n = batch * d * calls
    x, y = make_x(n, g), make_y(n, g)
    torch.manual_seed(0)
    model = kind()
    ours = copy.deepcopy(model)
    ddp = torch.nn.parallel.DistributedDataParallel(
        model.to(device), device_ids=[local] if device.type == "cuda" else None)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    opts = poptorch.Options().deviceIterations(d)
    opts.showCompilationProgressBar(False)
    pop = poptorch.trainingModel(ours, opts, torch.optim.SGD(ours.parameters(), lr=0.01))
    xd, yd = x.to(device), y.to(device)

    def ddp_pass():
        for a, b in zip(xd.split(batch), yd.split(batch), strict=False):
            opt.zero_grad()
            ddp(a, b)[1].backward()
            opt.step()
        sync(device)

    def pop_pass():
        for a, b in zip(x.split(batch * d), y.split(batch * d), strict=False):
            pop(a, b)
        sync(device)
    pop_pass()
    ddp_pass()
    times = {"ddp": [], "pop": []}
    for _ in range(2 if smoke else 5):
        for key, fn in (("pop", pop_pass), ("ddp", ddp_pass)):
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            times[key].append(time.perf_counter() - t0)
    rates = {k: n * world / statistics.median(v) for k, v in times.items()}
    if rank == 0:
        with open(result_path, "w") as f:
            f.write(f"| {world} | {backend} | {rates['ddp']:,.0f} | {rates['pop']:,.0f} | "
                    f"{rates['pop'] / rates['ddp']:.2f} |\n")
    # End as a careful program does: release what holds the process group (poptorch's
    # program, DDP's reducer) on every rank, then leave the group together. A rank that
    # destroys the group or exits while its peer still holds gloo pairs can abort it.
    dist.barrier()
    pop.destroy()
    ddp = opt = pop = None  # noqa: F841  (drops the last references)
    dist.barrier()
    dist.destroy_process_group()


def ddp_section(processes: int, smoke: bool, out) -> None:
    import subprocess
    import tempfile
    out.append(f"## torchrun, {processes} process(es): poptorch trainingModel vs DDP "
               "(CNN, samples/s over all processes)\n")
    if processes < 2:
        out.append(f"Skipped: needs 2 GPUs, {processes} found.\n")
        return
    out.mark("plan", f"ddp {processes} processes")
    out.append("| processes | backend | DDP | poptorch | poptorch/DDP |")
    out.append("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "ddp.md")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={processes}", os.path.abspath(__file__),
               "--ddp-worker", path] + (["--smoke"] if smoke else [])
        run = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=900,
                             env=dict(os.environ, OMP_NUM_THREADS="1"))
        if run.returncode == 0 and os.path.exists(path):
            with open(path) as f:
                out.append(f.read().rstrip())
        else:
            tail = (run.stdout + run.stderr).strip().splitlines()[-5:]
            out.append(f"| {processes} | failed (exit {run.returncode}) | "
                       f"{' / '.join(tail)[:400]} | | |")
    out.mark("done", f"ddp {processes} processes")
    out.append("")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny sizes: checks the script, not the device (--size smoke)")
    parser.add_argument("--size", choices=("smoke", "quick", "default"), default="default")
    parser.add_argument("--output", help="append the Markdown here (default: stdout)")
    parser.add_argument("--progress", help="append 'plan ROW' / 'done ROW' lines here")
    parser.add_argument("--sections", default="workloads,gpt2,ddp")
    parser.add_argument("--ddp-worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    # gpu_check.sh stops a section at its time budget with SIGINT: let it end the run
    # (what was measured is written already) also where SIGINT was ignored at start
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if args.ddp_worker:
        ddp_worker(args.ddp_worker, args.smoke)
        return 0
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_bench.py: no CUDA GPU found", file=sys.stderr)
        return 2
    size = "smoke" if args.smoke else args.size
    sections = set(args.sections.split(","))
    out = Report(args.output, args.progress)
    if "workloads" in sections:
        names, d, micro, seconds = {"smoke": (["tiny"], 2, 4, 0.05),
                                    "quick": (["mlp"], 16, 32, 0.2),
                                    "default": (["mlp", "cnn", "gpt"], 16, 64, 0.5)}[size]
        workloads_section(device, names, d, micro, seconds, out)
    if "gpt2" in sections:
        gpt2_section(device, size, out)
    if "ddp" in sections:
        gpus = torch.cuda.device_count() if device.type == "cuda" else 2
        ddp_section(max(1, gpus), size == "smoke", out)
    if not args.output:
        print("\n".join(out.lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
