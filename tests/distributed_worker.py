"""The program tests/test_distributed.py starts under torchrun: one scenario per run.

    torchrun --standalone --nproc_per_node=2 tests/distributed_worker.py SCENARIO OUT_DIR

Each process writes what it saw to ``OUT_DIR/<name>_rank<rank>.pt`` (or ``.txt`` for an
error); the test compares the processes with each other and with references it
computes itself. Every process starts from a different random initialisation
(``make_model(1000 + rank)``): the run must start from process 0's.
"""
from __future__ import annotations

import os
import pathlib
import signal
import sys
import time

import torch

import poptorch
from _distributed_cases import (CALLS, D, FEATURES, G, M, Branchy, Grouped, branchy_batch,
                                grouped_batch, PIPELINE_G, pipeline_batch,
                                model_parallel_strategies,
                                config_id, global_batch, make_model, options,
                                process_rows, run_poptorch, train_configs)

RANK = int(os.environ["RANK"])
WORLD = int(os.environ["WORLD_SIZE"])


def save(out: pathlib.Path, name: str, value) -> None:
    torch.save(value, out / f"{name}_rank{RANK}.pt")


def train(out: pathlib.Path, only: str | None = None) -> None:
    for cfg in train_configs():
        if only is not None and config_id(cfg) != only:
            continue
        cfg = dict(cfg, processes=WORLD)
        model = make_model(1000 + RANK)
        training, losses = run_poptorch(model, cfg, RANK)
        save(out, config_id(cfg), {"state": model.state_dict(), "losses": losses,
                                   "optimizer": training._optimizer.state_dict()})


def dynamic(out: pathlib.Path) -> None:
    """Parameters used in some micro-batches of a step but not in its last one."""
    torch.manual_seed(1000 + RANK)
    model = Branchy()
    training = poptorch.trainingModel(model, options(1),
                                      poptorch.optim.SGD(model.parameters(), lr=0.1))
    for call in range(CALLS):
        training(*process_rows(branchy_batch(call, WORLD), RANK, 1))
    save(out, "dynamic", model.state_dict())


def user_group(out: pathlib.Path) -> None:
    """The program makes the process group itself (a non-default timeout, as users do):
    poptorch reuses it, and leaves it usable after training."""
    import datetime
    import torch.distributed as dist
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    cfg = {"r": 1, "reduction": "Mean", "optimizer": "SGD", "processes": WORLD}
    model = make_model(1000 + RANK)
    run_poptorch(model, cfg, RANK)
    total = torch.tensor([float(RANK + 1)])
    dist.all_reduce(total)  # still the user's, still working
    save(out, "user_group", {"state": model.state_dict(), "total": total})
    dist.destroy_process_group()


USE_B = {"now": True}  # shared by the user's model and the executor's copy of it


class Switchable(torch.nn.Module):
    """Head ``b`` is used only while ``USE_B["now"]`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(FEATURES, 3)
        self.b = torch.nn.Linear(FEATURES, 3)

    def forward(self, x, y):
        out = self.a(x) + self.b(x) if USE_B["now"] else self.a(x)
        return out, torch.nn.functional.cross_entropy(out, y)


def unused_later(out: pathlib.Path) -> None:
    """Every parameter is used in the first step, head b no longer in the second: an
    error on both processes and no update; with POPTORCH_DISTRIBUTED_FIND_UNUSED=1 the
    same run trains."""
    results = {}
    for forced in (False, True):
        os.environ["POPTORCH_DISTRIBUTED_FIND_UNUSED"] = "1" if forced else "0"
        torch.manual_seed(7)
        USE_B["now"] = True
        model = Switchable()
        training = poptorch.trainingModel(model, options(1),
                                          torch.optim.SGD(model.parameters(), lr=0.1))
        training(*process_rows(global_batch(0, WORLD), RANK, 1))
        training.copyWeightsToHost()
        after_first = {k: v.clone() for k, v in model.state_dict().items()}
        USE_B["now"] = False
        try:
            training(*process_rows(global_batch(1, WORLD), RANK, 1))
            error = "no error"
        except poptorch.Error as exc:
            error = str(exc)
        training.copyWeightsToHost()
        results[forced] = {"error": error, "after_first": after_first,
                           "after_second": model.state_dict()}
        training.destroy()
    save(out, "unused_later", results)


def groups(out: pathlib.Path) -> None:
    """2 processes x 2 replicas, W grouped in groups of 2 replicas."""
    for kind in ("Consecutive", "Orthogonal"):
        model = Grouped(2)
        opts = poptorch.Options().replicationFactor(2)
        opts.showCompilationProgressBar(False)
        training = poptorch.trainingModel(model, opts,
                                          torch.optim.SGD(model.parameters(), lr=0.05))
        training.W.replicaGrouping(getattr(poptorch.CommGroupType, kind), 2,
                                   poptorch.VariableRetrievalMode.OnePerGroup)
        for call in range(CALLS):
            x = grouped_batch(call, 2 * WORLD)
            training(x[2 * RANK:2 * RANK + 2].reshape(-1, FEATURES))
        save(out, f"groups_{kind}", model.W.detach())
    # AllReplicas: the host holds all 4 replicas' slices (Orthogonal: groups {0, 2},
    # {1, 3}, spread over both processes); slices of a group start and stay equal.
    model = Grouped(2)
    with torch.no_grad():
        model.W = torch.nn.Parameter(model.W[torch.tensor([0, 1, 0, 1])].clone())
    opts = poptorch.Options().replicationFactor(2)
    opts.showCompilationProgressBar(False)
    training = poptorch.trainingModel(model, opts,
                                      torch.optim.SGD(model.parameters(), lr=0.05))
    training.W.replicaGrouping(poptorch.CommGroupType.Orthogonal, 2,
                               poptorch.VariableRetrievalMode.AllReplicas)
    for call in range(CALLS):
        x = grouped_batch(call, 2 * WORLD)
        training(x[2 * RANK:2 * RANK + 2].reshape(-1, FEATURES))
    save(out, "groups_AllReplicas", model.W.detach())


def strategies(out: pathlib.Path) -> None:
    """Each process holds a whole 2-IPU model run with each execution strategy."""
    for name, strategy in model_parallel_strategies().items():
        model = make_model(1000 + RANK)
        poptorch.BeginBlock(model.fc1, "0", ipu_id=0)
        poptorch.BeginBlock(model.fc2, "1", ipu_id=1)
        opts = poptorch.Options().deviceIterations(1)
        opts.Training.gradientAccumulation(PIPELINE_G)
        opts.setExecutionStrategy(strategy)
        opts.showCompilationProgressBar(False)
        training = poptorch.trainingModel(model, opts,
                                          poptorch.optim.SGD(model.parameters(), lr=0.1))
        for call in range(CALLS):
            x, y = pipeline_batch(call, WORLD)
            training(x[:, RANK].reshape(-1, FEATURES), y[:, RANK].reshape(-1))
        save(out, name, model.state_dict())


def buffers(out: pathlib.Path) -> None:
    for broadcast in (True, False):
        cfg = {"r": 1, "reduction": "Mean", "optimizer": "SGD", "processes": WORLD}
        model = make_model(1000 + RANK, batchnorm=True)
        opts = options(1, broadcast_buffers=broadcast)
        training = poptorch.trainingModel(
            model, opts, poptorch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
        for call in range(CALLS):
            training(*process_rows(global_batch(call, WORLD), RANK, cfg["r"]))
        save(out, f"buffers_{broadcast}", model.state_dict())


def checkpoint(out: pathlib.Path) -> None:
    cfg = {"r": 1, "reduction": "Mean", "optimizer": "Adam", "processes": WORLD}
    model = make_model(1000 + RANK)
    training, _ = run_poptorch(model, cfg, RANK)
    if RANK == 0:
        torch.save({"model": model.state_dict(),
                    "optimizer": training._optimizer.state_dict()}, out / "checkpoint.pt")
    for call in range(CALLS, 2 * CALLS):
        training(*process_rows(global_batch(call, WORLD), RANK, 1))
    save(out, "continued", model.state_dict())
    if RANK == 0:  # evaluation on one process only: inference needs no collectives
        x, y = process_rows(global_batch(0, WORLD), RANK, 1)
        output, _ = poptorch.inferenceModel(model, _inference_options())(x, y)
        torch.save({"x": x, "y": y, "output": output}, out / "inference_rank0.pt")


def _inference_options() -> poptorch.Options:
    opts = poptorch.Options().deviceIterations(D)
    opts.showCompilationProgressBar(False)
    return opts


MISMATCHES = {  # option name -> how process k sets it
    "deviceIterations": lambda opts, k: opts.deviceIterations(D + k),
    "replicationFactor": lambda opts, k: opts.replicationFactor(1 + k),
    "Training.gradientAccumulation": lambda opts, k: opts.Training.gradientAccumulation(
        G + k),
    "setExecutionStrategy": lambda opts, k: opts.setExecutionStrategy(
        [poptorch.ShardedExecution, poptorch.PipelinedExecution][k]()),
}


def mismatch(out: pathlib.Path) -> None:
    """For each option of MISMATCHES, the processes compile with different values; the
    message each process gets is saved (one run: a refused compile leaves the processes
    able to compile again)."""
    messages = {}
    for name, set_option in MISMATCHES.items():
        opts = options(1)
        set_option(opts, RANK)
        rows = (opts.device_iterations * opts.Training.gradient_accumulation
                * opts.replication_factor * M)
        training = poptorch.trainingModel(make_model(0), opts)
        try:
            training(torch.randn(rows, FEATURES), torch.zeros(rows, dtype=torch.long))
            messages[name] = "no error"
        except poptorch.Error as exc:
            messages[name] = str(exc)
    save(out, "mismatch", messages)
    sys.exit(3 if all(m != "no error" for m in messages.values()) else 0)


def kill(out: pathlib.Path) -> None:
    """Process 1 dies (SIGKILL) after its first call; process 0 keeps training."""
    model = make_model(0)
    training = poptorch.trainingModel(model, options(1))
    for call in range(1000):
        training(*process_rows(global_batch(call % 3, WORLD), RANK, 1))
        if RANK == 1:
            os.kill(os.getpid(), signal.SIGKILL)
    (out / f"finished_rank{RANK}.txt").write_text("finished")


def fault(out: pathlib.Path, how: str) -> None:
    """Started without torchrun (nobody stops the survivor): after its third call
    process 1 dies (``how`` = "kill") or stops taking part until process 0 has given up
    ("stall"). Process 0 records what its training loop raised and after how long."""
    model = make_model(0)
    training = poptorch.trainingModel(model, options(1))
    start = time.monotonic()
    try:
        for call in range(1000):
            training(*process_rows(global_batch(call % 3, WORLD), RANK, 1))
            if RANK == 1 and call == 2:
                if how == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                while not (out / "error_rank0.txt").exists() and \
                        time.monotonic() - start < 90:
                    time.sleep(0.1)
                os._exit(0)  # without the process group's goodbye
    except Exception as exc:  # noqa: BLE001 - the test checks its type
        seconds = time.monotonic() - start
        action = getattr(exc, "recovery_action", None)
        (out / f"error_rank{RANK}.txt").write_text(
            f"{type(exc).__module__}.{type(exc).__name__} after {seconds:.1f}s: {exc} "
            f"(recovery_action={action})")
        sys.exit(3)


def epoch(out: pathlib.Path) -> None:
    """The item ids each process reads in one epoch, for drop_last True and False (the
    second without randomSeed: the processes must agree on a shuffling seed)."""
    dataset = torch.arange(103).float().unsqueeze(1)
    seen = {}
    for drop_last in (True, False):
        opts = poptorch.Options().deviceIterations(2)
        if drop_last:
            opts.randomSeed(7)
        loader = poptorch.DataLoader(opts, dataset, batch_size=3, shuffle=True,
                                     drop_last=drop_last)
        seen[drop_last] = [batch.reshape(-1).long().tolist() for batch in loader]
    # inference over each process's share: every process gets its own outputs
    torch.manual_seed(5)
    model = torch.nn.Linear(1, 2)
    opts = poptorch.Options().deviceIterations(2)
    opts.showCompilationProgressBar(False)
    inference = poptorch.inferenceModel(model, opts)
    loader = poptorch.DataLoader(opts, dataset, batch_size=3)
    seen["inference"] = [(batch, inference(batch)) for batch in loader]
    save(out, "epoch", seen)


def _fail_code_generation_here() -> None:
    """Make this process's compiled backend fail in code generation: a torch.compile
    backend that raises, named by POPTORCH_TORCH_COMPILE_BACKEND."""
    from torch._dynamo import register_backend

    @register_backend
    def poptorch_test_fails_here(gm, example_inputs):
        raise RuntimeError(f"injected code generation failure on process {RANK}")
    os.environ["POPTORCH_TORCH_COMPILE_BACKEND"] = "poptorch_test_fails_here"


def compiled(out: pathlib.Path, calls: str, reduction: str, optimizer: str,
             fail_on_rank_one: str = "0") -> None:
    """Training with the backend the test sets (POPTORCH_BACKEND): the compiled backend
    on each process, the processes agreeing on the backend."""
    cfg = {"r": 1, "reduction": reduction, "optimizer": optimizer, "processes": WORLD}
    net = make_model(1000 + RANK)
    if fail_on_rank_one == "1" and RANK == 1:
        _fail_code_generation_here()
    training, losses = run_poptorch(net, cfg, RANK, calls=int(calls))
    program = training._program
    save(out, "compiled", {"state": net.state_dict(), "losses": losses,
                           "compiled_kept": program.selector.compiled is not None,
                           "backend": training.backendInUse,
                           "ddp_reduces": program.cross.reducer is None})


SCENARIOS = {"train": train, "compiled": compiled, "dynamic": dynamic, "groups": groups,
             "unused_later": unused_later,
             "strategies": strategies, "buffers": buffers, "checkpoint": checkpoint,
             "mismatch": mismatch, "kill": kill, "fault": fault,
             "user_group": user_group, "epoch": epoch}

if __name__ == "__main__":
    torch.set_num_threads(1)
    scenario, out_dir = sys.argv[1], pathlib.Path(sys.argv[2])
    SCENARIOS[scenario](out_dir, *sys.argv[3:])
