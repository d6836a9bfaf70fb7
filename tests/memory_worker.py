"""The program tests/test_memory_distributed.py starts under torchrun:

    torchrun --standalone --nproc_per_node=2 tests/memory_worker.py OUT_DIR

Each process trains the models of tests/_memory_cases.py with and without replicated
tensor sharding of the optimizer state and writes what it saw to
``OUT_DIR/<name>_rank<rank>.pt``.
"""
from __future__ import annotations

import os
import pathlib
import sys

import torch

from poptorch.enums import CommGroupType
from _memory_cases import (CALLS, Grouped, adamw, elementwise_state_bytes, make_model,
                           options, train, train_grouped)

RANK = int(os.environ["RANK"])
WORLD = int(os.environ["WORLD_SIZE"])


def save(out: pathlib.Path, name: str, value) -> None:
    torch.save(value, out / f"{name}_rank{RANK}.pt")


def main(out: pathlib.Path) -> None:
    half = CALLS // 2
    for sharded in (False, True, 2, 3):
        if sharded == 2:  # one bucket per weight: gathers overlap the next update
            from poptorch._runtime.memory import layout
            layout.BUCKET_ELEMENTS = 30
        model = make_model(1000 + RANK)  # process 0's weights reach every process
        optimizer = adamw(model)
        training = train(model, options(1, sharded), optimizer, range(half), 1, RANK, WORLD)
        managed = training._program.managed_step
        if sharded == 3:  # the state's moves to and from host memory (GPUs), forced
            from poptorch._runtime.memory.offload import StateStorage
            managed.storage = StateStorage(True, force_stream=True)
        held = managed.state if managed is not None else optimizer.state
        local_bytes = elementwise_state_bytes(held)
        checkpoint = {"model": {k: v.clone() for k, v in model.state_dict().items()},
                      "optimizer": optimizer.state_dict()}  # every process calls it
        for call in range(half, CALLS):
            training(*_rows(call))
        save(out, f"adamw_sharded{int(sharded)}", {
            "weights": model.state_dict(), "state_dict": optimizer.state_dict(),
            "bytes": local_bytes, "checkpoint": checkpoint})
    for sharded in (False, True):
        model = Grouped(2)
        _, optimizer = train_grouped(model, 2, sharded, CommGroupType.Orthogonal, 2,
                                     first_replica=2 * RANK, total=2 * WORLD)
        save(out, f"grouped_sharded{int(sharded)}", {
            "weights": model.state_dict(), "state_dict": optimizer.state_dict()})


def _rows(call: int) -> tuple:
    from _memory_cases import global_batch, rows
    return rows(global_batch(call, WORLD), RANK, 1)


if __name__ == "__main__":
    main(pathlib.Path(sys.argv[1]))
