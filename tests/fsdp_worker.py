"""The program tests/test_memory_distributed.py starts under torchrun for weights and
accumulators sharded over the processes (``_runtime/memory/fsdp.py``):

    torchrun --standalone --nproc_per_node=2 tests/fsdp_worker.py OUT_DIR
    torchrun --standalone --nproc_per_node=4 tests/fsdp_worker.py OUT_DIR --resume-exact

Each process trains tests/_memory_cases.py's models with {weights, accumulators,
optimizer state} x {RTS, off chip} and writes what it saw to
``OUT_DIR/<name>_rank<rank>.pt``. ``--resume-exact`` resumes the exact-arithmetic run's
checkpoint (``OUT_DIR/exact_rank0.pt``, taken at 2 processes) sharded over the
processes of this run.
"""
from __future__ import annotations

import copy
import gc
import os
import pathlib
import sys
import weakref

import torch
from torch.distributed.tensor import DTensor

import poptorch
from _memory_cases import (CALLS, KINDS, Blocks, Exact, adamw, exact_options, exact_rows,
                           exact_sgd, location_options, make_model, process_rows)

RANK = int(os.environ["RANK"])
WORLD = int(os.environ["WORLD_SIZE"])


def save(out: pathlib.Path, name: str, value) -> None:
    torch.save(value, out / f"{name}_rank{RANK}.pt")


def train_case(kinds: tuple, rts: bool, off_chip: bool, checkpoint_at: int = -1,
               backend: str | None = None):
    model = make_model(1000 + RANK)  # process 0's weights reach every process
    optimizer = adamw(model)
    opts = location_options(kinds, rts, off_chip)
    opts.Jit.backend(backend)
    training = poptorch.trainingModel(model, opts, optimizer)
    checkpoint = None
    for call in range(CALLS):
        if call == checkpoint_at:
            checkpoint = {"model": {k: v.clone() for k, v in model.state_dict().items()},
                          "optimizer": optimizer.state_dict()}  # every process calls
        training(*process_rows(call, RANK, WORLD))
    sharded = [n for n, p in model.named_parameters() if isinstance(p, DTensor)]
    return {"weights": model.state_dict(), "state_dict": optimizer.state_dict(),
            "sharded": sharded, "checkpoint": checkpoint, "backend": training.backendInUse,
            "compiled_units": _compiled_units(training)}


def _compiled_units(training) -> bool:
    cross = training._program.spec.cross
    return cross is not None and cross.sharded is not None and cross.sharded.compiled_units


def exact_case(resume: dict | None = None) -> dict:
    """The exact-arithmetic model with all three RTS: from the start (a checkpoint
    after CALLS // 2 calls), or from ``resume``'s checkpoint; the whole weights after
    every call and the optimizer's whole state at the end."""
    model = Exact()
    optimizer = exact_sgd(model)
    first = 0
    if resume is not None:
        model.load_state_dict(resume["model"])
        optimizer.load_state_dict(resume["optimizer"])
        first = CALLS // 2
    training = poptorch.trainingModel(model, exact_options(WORLD, True), optimizer)
    after, checkpoint = {}, None
    for call in range(first, CALLS):
        if call == CALLS // 2 and resume is None:
            # (copies, as torch.save makes: a state dict refers to the live tensors)
            checkpoint = copy.deepcopy({"model": model.state_dict(),  # every process calls
                                        "optimizer": optimizer.state_dict()})
        training(*exact_rows(call, RANK, WORLD))
        after[call] = {k: v.clone() for k, v in model.state_dict().items()}
    return {"after": after, "checkpoint": checkpoint, "state_dict": optimizer.state_dict(),
            "sharded": [n for n, p in model.named_parameters() if isinstance(p, DTensor)]}


def freed_case() -> dict:
    """All three RTS, one step, then the program destroyed and everything dropped:
    whether the optimizer and the model are still alive after a garbage collection."""
    model = make_model(1000 + RANK)
    optimizer = adamw(model)
    training = poptorch.trainingModel(model, location_options(KINDS, True, False),
                                      optimizer)
    training(*process_rows(0, RANK, WORLD))
    refs = [weakref.ref(optimizer), weakref.ref(model)]
    training.destroy()
    del training, optimizer, model
    gc.collect()
    return {"alive": [ref() is not None for ref in refs]}


def peak_case() -> dict:
    """An 8-block model with weights RTS: the runtime's accounting, and an independent
    count by hooks on the blocks of how many blocks hold whole weights at once."""
    torch.manual_seed(3)
    model = Blocks()
    opts = location_options(("weight",), True, False, accumulation=1)
    training = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(),
                                                                   lr=0.1))
    seen: list[int] = []

    def whole_blocks(*_):
        seen.append(sum(not any(isinstance(p, DTensor) for p in b.parameters())
                        for b in model.blocks))

    for block in model.blocks:
        block.register_forward_hook(whole_blocks)
        block.register_full_backward_hook(whole_blocks)
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(RANK))
    training(x)
    seen.clear()
    training(x)
    accounting = training._program.spec.cross.sharded.accounting
    return {"seen": seen, "peak_units": accounting.peak_units,
            "peak_bytes": accounting.peak_bytes, "shard_bytes": accounting.shard_bytes,
            "unit_bytes": accounting.unit_bytes}


def main(out: pathlib.Path) -> None:
    if "--resume-exact" in sys.argv:
        resume = torch.load(out / "exact_rank0.pt", weights_only=False)["checkpoint"]
        save(out, f"exact_resumed{WORLD}", exact_case(resume))
        return
    save(out, "exact", exact_case())
    save(out, "plain", train_case((), False, False))
    for kind in KINDS:
        save(out, f"{kind}_rts", train_case((kind,), True, False))
        save(out, f"{kind}_offchip", train_case((kind,), False, True))
    save(out, "all_rts", train_case(KINDS, True, False, checkpoint_at=CALLS // 2))
    from poptorch._runtime.memory import fsdp
    fsdp.force_stream = True  # FSDP2's offload path on the CPU
    save(out, "all_rts_offchip", train_case(KINDS, True, True))
    for kind in KINDS:
        save(out, f"{kind}_both", train_case((kind,), True, True))
    # (aot_eager: the same graphs as inductor without its C++ build, as CI's compiled run)
    os.environ["POPTORCH_TORCH_COMPILE_BACKEND"] = "aot_eager"
    save(out, "all_rts_offchip_compiled", train_case(KINDS, True, True, backend="inductor"))
    for kind in KINDS:
        save(out, f"{kind}_both_compiled", train_case((kind,), True, True, backend="inductor"))
    del os.environ["POPTORCH_TORCH_COMPILE_BACKEND"]
    save(out, "peak", peak_case())
    save(out, "freed", freed_case())


if __name__ == "__main__":
    main(pathlib.Path(sys.argv[1]))
