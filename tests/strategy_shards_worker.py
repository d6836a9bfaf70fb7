"""The program tests/test_memory_strategies.py starts under torchrun: weights,
accumulators and optimizer state sharded over the processes (RTS) and / or off chip for
the execution strategies (``_runtime/memory/step_shards.py``):

    torchrun --standalone --nproc_per_node=2 tests/strategy_shards_worker.py OUT_DIR

Each process trains tests/_memory_cases.py's two-layer model split into two blocks,
pipelined and serial-phased, for each case and writes what it saw to
``OUT_DIR/<strategy>_<case>_rank<rank>.pt``.
"""
from __future__ import annotations

import os
import pathlib
import sys

import torch

import poptorch
from _memory_cases import (CALLS, STRATEGY_G, adamw, location_options, make_model,
                           process_rows, strategy_cases)

RANK = int(os.environ["RANK"])
WORLD = int(os.environ["WORLD_SIZE"])


def strategy(name: str) -> poptorch.options.ExecutionStrategy:
    if name == "pipelined":
        return poptorch.PipelinedExecution("b0", "b1")
    return poptorch.SerialPhasedExecution(poptorch.Phase("b0"), poptorch.Phase("b1"))


def train_case(strategy_name: str, kinds: tuple, rts: bool, off_chip: bool,
               backend: str | None) -> dict:
    model = make_model(1000 + RANK)  # process 0's weights reach every process
    model.fc1 = poptorch.BeginBlock(model.fc1, "b0", ipu_id=0)
    model.fc2 = poptorch.BeginBlock(model.fc2, "b1", ipu_id=1)
    optimizer = adamw(model)
    opts = location_options(kinds, rts, off_chip, accumulation=STRATEGY_G)
    opts.setExecutionStrategy(strategy(strategy_name))
    opts.Jit.backend(backend)
    training = poptorch.trainingModel(model, opts, optimizer)
    held = []
    for call in range(CALLS):
        training(*process_rows(call, RANK, WORLD, STRATEGY_G))
        step = _managed_step(optimizer)
        held.append(None if step is None else
                    (step.held_weight_bytes(), step.released))
    whole = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                if n.endswith("weight"))
    return {"weights": model.state_dict(), "state_dict": optimizer.state_dict(),
            "held": held, "whole_weight_bytes": whole, "backend": training.backendInUse}


def _managed_step(optimizer: torch.optim.Optimizer):
    """The step keeping shards between steps, if the program made one."""
    from poptorch._runtime.memory.sharding import _manager_of
    from poptorch._runtime.memory.step_shards import StepShardedStep
    step = _manager_of(optimizer)
    return step if isinstance(step, StepShardedStep) else None


def main(out: pathlib.Path) -> None:
    from poptorch._runtime.memory import fsdp
    fsdp.force_stream = True
    for strategy_name in ("pipelined", "phased"):
        for name, (kinds, rts, off_chip, backend) in strategy_cases().items():
            torch.save(train_case(strategy_name, kinds, rts, off_chip, backend),
                       out / f"{strategy_name}_{name}_rank{RANK}.pt")


if __name__ == "__main__":
    main(pathlib.Path(sys.argv[1]))
