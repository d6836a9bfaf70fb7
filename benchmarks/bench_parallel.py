"""Model parallelism against the loops and the pipeline a PyTorch user would run.

In one run, side by side, the same training steps (gradientAccumulation ``g``
micro-batches, then one SGD step) through:

* ``eager-1t`` / ``eager-2t``: the plain PyTorch loop with 1 and with 2 intra-op threads;
* ``unsplit``: ``poptorch.trainingModel`` of the model without annotations;
* ``sharded``: ``ShardedExecution`` (stages one after the other);
* ``pipe-gpipe`` / ``pipe-1f1b``: ``PipelinedExecution`` with the GPipe / 1F1B schedule;
* ``pipe-zb``: ``PipelinedExecution().setSchedule("ZeroBubble")`` (backwards split into
  input and weight halves, the weight halves in the bubbles);
* ``pipe-interleaved`` (4 stages on 2 IPUs): ``setSchedule("Interleaved1F1B")`` with
  blocks on IPUs 0, 1, 0, 1;
* ``phased``: ``SerialPhasedExecution`` (one phase per stage), weights streamed to the
  device while their phase runs: peak resident parameter bytes per device are printed
  against the unsplit model's;
* ``torch-gpipe`` / ``torch-1f1b``: ``torch.distributed.pipelining``
  (``ScheduleGPipe`` / ``Schedule1F1B``) over 2 processes (gloo, one thread each),
  the peer a PyTorch user would pick; ``torch-interleaved`` / ``torch-izb``:
  ``ScheduleInterleaved1F1B`` / ``ScheduleInterleavedZeroBubble`` with 2 stages per
  process (4 in all), where they run;
* ``procs-gpipe`` / ``procs-1f1b`` (2 stages): ``PipelinedExecution`` with
  ``Options.Distributed.stagesOnProcesses()``, one stage per process on the same 2
  processes (built on ``torch.distributed.pipelining``; every process also receives
  the outputs), printed with its ratio to torch's pipeline.

Workloads: an MLP (8 x ``Linear(512, 512)``, micro-batch 32) and a small transformer
(4 ``TransformerEncoderLayer``, d_model 128, sequence 32, micro-batch 16), 2 stages
(4 where it fits), g = 8 and 16. Throughput is samples/s, the median over interleaved
rounds; ratios are against ``eager-1t``. The poptorch contenders run with 1 intra-op
thread in the calling thread; pipeline workers get ``cores / devices`` each.

Targets (issue 37), 2 devices, g=8, MLP and transformer: the best pipelined schedule
>= 1.65 x eager-1t and >= 1.0 x the best torch 2-process pipeline; sharded >= 0.95 x
eager-1t.

Run: ``python benchmarks/bench_parallel.py [--quick]`` (under ``flock -x /tmp/cpu.lock``;
about 3 minutes, ``--quick`` about 1.5).
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import time

import torch
import torch.multiprocessing as mp

FEAT, MLP_LAYERS, MLP_MB = 512, 8, 32
D_MODEL, SEQ, TR_LAYERS, TR_MB = 128, 32, 4, 16


# --------------------------------------------------------------------------- models
class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(FEAT, FEAT)
                                          for _ in range(MLP_LAYERS))

    def forward(self, x, y):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x, torch.nn.functional.mse_loss(x, y)


class Transformer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(
            torch.nn.TransformerEncoderLayer(D_MODEL, 4, 4 * D_MODEL, dropout=0.0,
                                             batch_first=True)
            for _ in range(TR_LAYERS))

    def forward(self, x, y):
        for layer in self.layers:
            x = layer(x)
        return x, torch.nn.functional.mse_loss(x, y)


def make_model(name):
    torch.manual_seed(0)
    return MLP() if name == "mlp" else Transformer()


def make_data(name, g):
    torch.manual_seed(1)
    if name == "mlp":
        shape = (g * MLP_MB, FEAT)
    else:
        shape = (g * TR_MB, SEQ, D_MODEL)
    return torch.randn(shape), torch.randn(shape)


def mb_size(name):
    return MLP_MB if name == "mlp" else TR_MB


def annotate(model, stages, ipus=None):
    """BeginBlock at equal layer intervals; stage k on IPU ``ipus[k]`` (default k)."""
    import poptorch
    layers = model.layers
    per = len(layers) // stages
    for k in range(stages):
        ipu = k if ipus is None else ipus[k]
        poptorch.BeginBlock(layers[k * per], f"s{k}", ipu)
    return model


# --------------------------------------------------------------------------- contenders
class EagerLoop:
    def __init__(self, name, g, threads):
        self.model, self.g, self.threads = make_model(name), g, threads
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-3)
        self.x, self.y = make_data(name, g)
        self.mb = mb_size(name)

    def step(self):
        torch.set_num_threads(self.threads)
        try:
            self.opt.zero_grad()
            for m in range(self.g):
                sl = slice(m * self.mb, (m + 1) * self.mb)
                (self.model(self.x[sl], self.y[sl])[1] / self.g).backward()
            self.opt.step()
        finally:
            torch.set_num_threads(1)


class PopTorch:
    def __init__(self, name, g, stages=0, strategy=None, ipus=None, processes=False):
        import poptorch
        model = make_model(name)
        if stages:
            annotate(model, stages, ipus)
        opts = poptorch.Options()
        opts.Training.gradientAccumulation(g)
        opts.show_compilation_progress_bar = False
        if processes:
            opts.Distributed.stagesOnProcesses()
        if strategy is not None:
            opts.setExecutionStrategy(strategy)
        self.strategy = strategy
        self.model = model
        self.training = poptorch.trainingModel(
            model, opts, torch.optim.SGD(model.parameters(), lr=1e-3))
        self.x, self.y = make_data(name, g)

    def step(self):
        self.training(self.x, self.y)

    def runner(self):
        runner = self.training._program.runner
        while not hasattr(runner, "partition") and hasattr(runner, "inner"):
            runner = runner.inner
        return runner


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _peer_main(rank, port, conn):
    """A rank of the 2-process pipelines: builds stage ``rank`` of the requested model
    (``torch.distributed.pipelining`` by hand, or poptorch with stages on processes for
    kinds ``procs-*``) and runs the requested steps when rank 0 is told to."""
    import torch.distributed as dist
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
        ScheduleInterleavedZeroBubble,
    )
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    cache = {}
    while True:
        cmd = [conn.recv() if rank == 0 else None]
        dist.broadcast_object_list(cmd, src=0)
        if cmd[0] is None:
            break
        name, g, kind, steps = cmd[0]
        key = (name, g, kind)
        if key not in cache and kind.startswith("procs-"):
            import poptorch
            strategy = poptorch.PipelinedExecution().setSchedule(
                "GPipe" if kind == "procs-gpipe" else "1F1B")
            run = PopTorch(name, g, 2, strategy, processes=True)
            cache[key] = (run, None, (None, None))
        elif key not in cache and kind in ("interleaved", "izb"):
            model = make_model(name)  # 4 stages: rank r holds stages r and r + 2
            quarter = len(model.layers) // 4
            parts, stages = [], []
            for index in (rank, rank + 2):
                layers = model.layers[index * quarter:(index + 1) * quarter]
                if name == "mlp":
                    layers = [torch.nn.Sequential(layer, torch.nn.ReLU()) for layer in layers]
                parts.append(torch.nn.Sequential(*layers))
                stages.append(PipelineStage(parts[-1], index, 4, torch.device("cpu")))
            cls = ScheduleInterleaved1F1B if kind == "interleaved" else \
                ScheduleInterleavedZeroBubble
            try:  # (a schedule this torch refuses for this shape is left out)
                schedule = cls(stages, n_microbatches=g,
                               loss_fn=lambda out, target, g=g:
                               torch.nn.functional.mse_loss(out, target) / g)
            except Exception:  # pylint: disable=broad-except
                cache[key] = None
            else:
                params = [p for part in parts for p in part.parameters()]
                cache[key] = (schedule, torch.optim.SGD(params, lr=1e-3),
                              make_data(name, g))
        elif key not in cache:
            model = make_model(name)
            half = len(model.layers) // 2
            layers = model.layers[rank * half:(rank + 1) * half]
            if name == "mlp":  # the MLP applies relu after each layer
                layers = [torch.nn.Sequential(layer, torch.nn.ReLU()) for layer in layers]
            part = torch.nn.Sequential(*layers)
            stage = PipelineStage(part, rank, 2, torch.device("cpu"))
            cls = ScheduleGPipe if kind == "gpipe" else Schedule1F1B
            schedule = cls(stage, n_microbatches=g,
                           loss_fn=lambda out, target, g=g: torch.nn.functional.mse_loss(
                               out, target) / g)
            cache[key] = (schedule, torch.optim.SGD(part.parameters(), lr=1e-3),
                          make_data(name, g))
        if cache[key] is None:
            if rank == 0:
                conn.send(None)
            continue
        schedule, opt, (x, y) = cache[key]
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(steps):
            if opt is None:  # poptorch: the executor runs the schedule and the step
                schedule.step()
                continue
            opt.zero_grad()
            if rank == 0:
                schedule.step(x)
            else:
                schedule.step(target=y)
            opt.step()
        dist.barrier()
        if rank == 0:
            conn.send(time.perf_counter() - t0)
    # Release what holds the process groups (poptorch's stage runners and their
    # groups, torch's stages) on both ranks, then leave together: a rank tearing gloo
    # down while its peer still holds pairs can abort the peer.
    cache.clear()
    import gc
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


class TorchPeer:
    """The 2-process ``torch.distributed.pipelining`` pipeline (started once)."""

    def __init__(self):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        port = _free_port()
        os.environ["OMP_NUM_THREADS"] = "1"
        self.procs = [ctx.Process(target=_peer_main, args=(r, port, child if r == 0 else None))
                      for r in range(2)]
        for p in self.procs:
            p.start()

    def timed(self, name, g, kind, steps):
        self.conn.send((name, g, kind, steps))
        return self.conn.recv()

    def close(self):
        self.conn.send(None)
        for p in self.procs:
            p.join(30)


# --------------------------------------------------------------------------- driver
def contenders(name, g, stages):
    import poptorch
    out = {
        "eager-1t": lambda: EagerLoop(name, g, 1),
        "eager-2t": lambda: EagerLoop(name, g, 2),
        "unsplit": lambda: PopTorch(name, g),
        "sharded": lambda: PopTorch(name, g, stages, poptorch.ShardedExecution()),
        "pipe-gpipe": lambda: PopTorch(name, g, stages,
                                       poptorch.PipelinedExecution().setSchedule("GPipe")),
        "pipe-1f1b": lambda: PopTorch(name, g, stages, poptorch.PipelinedExecution()),
        "pipe-zb": lambda: PopTorch(name, g, stages,
                                    poptorch.PipelinedExecution().setSchedule("ZeroBubble")),
        "phased": lambda: PopTorch(name, g, stages, _phased(stages)),
    }
    if stages == 2:
        out["pipe-interleaved"] = lambda: PopTorch(
            name, g, 4, poptorch.PipelinedExecution().setSchedule("Interleaved1F1B"),
            ipus=[0, 1, 0, 1])
    return out


def _phased(stages):
    import poptorch
    strategy = poptorch.SerialPhasedExecution(
        *[poptorch.Phase(poptorch.Stage(f"s{k}")) for k in range(stages)])
    strategy.setTensorsLiveness(poptorch.Liveness.OffChipAfterEachPhase)
    return strategy


def measure(name, g, stages, rounds, steps, peer):
    samples = g * mb_size(name)
    runs = {k: make() for k, make in contenders(name, g, stages).items()}
    for run in runs.values():  # compile + warm up
        run.step()
        run.step()
    times = {k: [] for k in runs}
    peer_kinds = ["gpipe", "1f1b"] if peer is not None and stages == 2 else []
    peer_kinds += [f"procs-{k}" for k in peer_kinds]
    if peer_kinds:
        peer_kinds += ["interleaved", "izb"]
    label = {k: k if k.startswith("procs-") else f"torch-{k}" for k in peer_kinds}
    for kind in list(peer_kinds):
        times[label[kind]] = []
        if peer.timed(name, g, kind, 2) is None:  # build + warm up
            print(f"  (torch's {kind} schedule did not run here; left out)")
            peer_kinds.remove(kind)
            del times[label[kind]]
    for _ in range(rounds):
        for k, run in runs.items():
            t0 = time.perf_counter()
            for _ in range(steps):
                run.step()
            times[k].append((time.perf_counter() - t0) / steps)
        for kind in peer_kinds:
            times[label[kind]].append(peer.timed(name, g, kind, steps) / steps)
    rate = {k: samples / statistics.median(v) for k, v in times.items()}
    base = rate["eager-1t"]
    print(f"\n{name}, {stages} stages (interleaved: 4 on 2 IPUs), g={g}, "
          f"micro-batch {mb_size(name)}: samples/s (ratio to eager-1t)")
    for k, r in rate.items():
        print(f"  {k:18s} {r:9.1f}  {r / base:5.2f}x")
    torch_best = max((rate[k] for k in rate if k.startswith("torch-")), default=None)
    best = max((k for k in rate if k.startswith("pipe-")), key=rate.__getitem__)
    pipe_best = rate[best]
    print(f"  best pipelined schedule: {best}, {pipe_best / base:.2f}x eager-1t")
    if torch_best:
        print(f"  pipelined (best) / torch 2-process pipeline (best): "
              f"{pipe_best / torch_best:.2f}x")
        for kind in ("gpipe", "1f1b"):
            print(f"  procs-{kind} / torch-{kind} (stages on processes / torch's own): "
                  f"{rate[f'procs-{kind}'] / rate[f'torch-{kind}']:.2f}x")
    phased = runs["phased"].runner()
    full = sum(p.numel() * p.element_size() for p in runs["unsplit"].model.parameters())
    mem = phased.streaming
    print(f"  phased: peak resident parameter bytes {mem.peak_resident_bytes} "
          f"(all devices; {stages} phases) vs unsplit {full} "
          f"({mem.peak_resident_bytes / full:.2f}x)")
    record = runs["pipe-1f1b"].strategy.last_schedule
    print(f"  pipe-1f1b last_schedule (user's strategy object): bubble fraction "
          f"{record.bubble_fraction():.3f}")
    return rate


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds (about half)")
    parser.add_argument("--config", action="append", default=[],
                        help="only this workload, e.g. mlp:8:2 (model:g:stages)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rounds, steps = (3, 1) if args.quick else (5, 2)
    print(f"cores: {os.cpu_count()}, torch {torch.__version__}, rounds {rounds} x "
          f"{steps} step(s), median")
    peer = TorchPeer()
    try:
        configs = [("mlp", 8, 2), ("mlp", 16, 2), ("transformer", 8, 2),
                   ("transformer", 16, 2)]
        if not args.quick:
            configs.append(("mlp", 8, 4))
        if args.config:
            configs = [(c.split(":")[0], int(c.split(":")[1]), int(c.split(":")[2]))
                       for c in args.config]
        for name, g, stages in configs:
            measure(name, g, stages, rounds, steps, peer)
    finally:
        peer.close()


if __name__ == "__main__":
    main()
