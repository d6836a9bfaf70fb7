"""The program tests/test_stage_processes.py starts under torchrun: a 2-stage pipelined
model whose stages run on the 2 processes (``Distributed.stagesOnProcesses``).

    torchrun --standalone --nproc_per_node=2 tests/stage_process_worker.py OUT_DIR

For each schedule (GPipe, 1F1B) every process trains the model (each process starts
from a different random initialisation: the run must start from process 0's), then
writes the losses and outputs it returned and, after ``copyWeightsToHost``, the full
``state_dict`` to ``OUT_DIR/<schedule>_rank<rank>.pt``; then the trained model runs as
an inference model (``OUT_DIR/inference_rank<rank>.pt``). The test compares them with
plain PyTorch.
"""
from __future__ import annotations

import os
import pathlib
import sys

import torch

import poptorch
from _stage_process_cases import (CALLS, OUTPUT_MODES, SCHEDULES, batch, make_model,
                                  options)

RANK = int(os.environ["RANK"])


def main(out: pathlib.Path) -> None:
    torch.set_num_threads(1)
    for schedule in SCHEDULES:
        model = make_model(seed=1000 + RANK, annotate=True)
        strategy = poptorch.PipelinedExecution().setSchedule(schedule)
        opts = options(strategy, stage_processes=True, output_mode=OUTPUT_MODES[schedule])
        training = poptorch.trainingModel(model, opts,
                                          torch.optim.SGD(model.parameters(), lr=0.1))
        losses, outputs = [], []
        for call in range(CALLS):
            output, loss = training(*batch(call))
            outputs.append(output)
            losses.append(loss)
        training.copyWeightsToHost()
        record = strategy.last_schedule
        torch.save({"state": model.state_dict(), "losses": losses, "outputs": outputs,
                    "schedule": [record.stage_order(s) for s in range(2)]},
                   out / f"{schedule}_rank{RANK}.pt")
        training.destroy()
    # inference of the trained model (every process holds all of it after the copy):
    # 2 device iterations of G micro-batches, every output returned
    opts = poptorch.Options().deviceIterations(2).showCompilationProgressBar(False)
    opts.setExecutionStrategy(poptorch.PipelinedExecution())
    opts.Distributed.stagesOnProcesses()
    inference = poptorch.inferenceModel(model, opts)
    x, y = batch(CALLS)
    x, y = torch.cat([x, x * 2]), torch.cat([y, y])
    torch.save(inference(x, y), out / f"inference_rank{RANK}.pt")
    inference.destroy()
    # leave the process group together: a rank tearing gloo down while its peer still
    # writes can abort the peer
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(pathlib.Path(sys.argv[1]))
