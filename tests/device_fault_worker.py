"""The program tests/test_device_faults.py starts as 2 processes (gloo, no launcher, so
nobody stops the survivor): after its third call process 1 dies (``kill``: SIGKILL) or
stops taking part (``stall``) while process 0 trains on. Process 0 records what its
failed call raised and whether its weights and optimizer state are those from before
that call, in ``OUT_DIR/fault.pt``.

    RANK=r WORLD_SIZE=2 MASTER_ADDR=... MASTER_PORT=... device_fault_worker.py OUT_DIR HOW
"""
from __future__ import annotations

import copy
import os
import pathlib
import signal
import sys
import time

import torch
import torch.nn.functional as F

import poptorch

RANK = int(os.environ["RANK"])


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)

    def forward(self, x, y):
        out = self.fc(x)
        return out, F.mse_loss(out, y)


def state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple:
    return copy.deepcopy((model.state_dict(), optimizer.state_dict()["state"]))


def equal(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(
            equal(a[k], b[k]) for k in a)
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def main(out: pathlib.Path, how: str) -> None:
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opts = poptorch.Options()
    opts.showCompilationProgressBar(False)
    training = poptorch.trainingModel(model, opts, optimizer)
    start = time.monotonic()
    for call in range(1000):
        generator = torch.Generator().manual_seed(10 * call + RANK)
        x, y = torch.randn(4, 4, generator=generator), torch.randn(4, 3, generator=generator)
        before = state(model, optimizer)
        try:
            training(x, y)
        except Exception as exc:  # (any: the test checks what it is)
            torch.save({"type": f"{type(exc).__module__}.{type(exc).__name__}",
                        "recovery_action": getattr(exc, "recovery_action", None),
                        "cause": type(exc.__cause__).__name__, "message": str(exc),
                        "calls": call, "seconds": time.monotonic() - start,
                        "unchanged": equal(before, state(model, optimizer))},
                       out / "fault.pt")
            sys.exit(3)
        if RANK == 1 and call == 2:
            if how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            while not (out / "fault.pt").exists() and time.monotonic() - start < 90:
                time.sleep(0.1)
            os._exit(0)  # without the process group's goodbye


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(pathlib.Path(sys.argv[1]), sys.argv[2])
