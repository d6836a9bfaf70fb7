"""The model, data and options shared by tests/test_stage_processes.py and the
program it starts under torchrun (tests/stage_process_worker.py)."""
from __future__ import annotations

import torch

import poptorch

CALLS, G, M, FEATURES = 3, 4, 2, 6  # G >= 2 x stages - 1 for a 2-stage pipeline
SCHEDULES = ("GPipe", "1F1B")


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = torch.nn.Linear(FEATURES, 8)
        self.l2 = torch.nn.Linear(8, 8)
        self.l3 = torch.nn.Linear(8, 3)

    def forward(self, x, y):
        h = torch.relu(self.l1(x))
        h = torch.tanh(self.l2(h)) + h  # l1's output also crosses into stage 1
        out = self.l3(h)
        return out, torch.nn.functional.cross_entropy(out, y)


def make_model(seed: int, annotate: bool) -> Net:
    torch.manual_seed(seed)
    model = Net()
    if annotate:
        poptorch.BeginBlock(model.l1, "s0", ipu_id=0)
        poptorch.BeginBlock(model.l2, "s1", ipu_id=1)
    return model


def batch(call: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(300 + call)
    return (torch.randn(G * M, FEATURES, generator=g),
            torch.randint(0, 3, (G * M, ), generator=g))


# per schedule: the output mode its run returns (All: every micro-batch's)
OUTPUT_MODES = {"GPipe": "All", "1F1B": "Default"}


def options(strategy, stage_processes: bool = False,
            output_mode: str = "All") -> poptorch.Options:
    opts = poptorch.Options()
    opts.Training.gradientAccumulation(G)
    opts.outputMode(getattr(poptorch.OutputMode, output_mode))
    opts.showCompilationProgressBar(False)
    opts.setExecutionStrategy(strategy)
    if stage_processes:
        opts.Distributed.stagesOnProcesses()
    return opts


def plain_reference(model: Net) -> tuple[list, list]:
    """Plain PyTorch: per call, one SGD step on the mean of the G micro-batch losses;
    returns the per-micro-batch outputs and losses of every call."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    outputs, losses = [], []
    for call in range(CALLS):
        x, y = batch(call)
        optimizer.zero_grad()
        outs = [model(x[m * M:(m + 1) * M], y[m * M:(m + 1) * M]) for m in range(G)]
        torch.stack([loss for _, loss in outs]).mean().backward()
        optimizer.step()
        outputs.append(torch.cat([o.detach() for o, _ in outs]))
        losses.append(torch.stack([loss.detach() for _, loss in outs]))
    return outputs, losses
