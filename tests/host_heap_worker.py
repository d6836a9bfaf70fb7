"""Run by tests/test_host_heap.py in a fresh process: minor page faults per training step
of a model whose step frees its activations together, and the weights against plain torch."""
import json
import resource
import sys

import torch

import poptorch

torch.set_num_threads(1)


class Wide(torch.nn.Module):
    """A step whose activations (4 MiB each) are all freed together at its end."""

    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.linspace(0.5, 1.5, 4096))

    def forward(self, x):
        h = torch.tanh(x * self.scale)
        h = torch.sigmoid(h * self.scale) * h
        return poptorch.identity_loss((h * self.scale).square().mean(), "none")


def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


torch.manual_seed(0)
xs = [torch.randn(256, 4096) for _ in range(8)] * 4  # 32 steps
model, reference = Wide(), Wide()
opts = poptorch.Options()
opts.Jit.backend("eager")
opts.showCompilationProgressBar(False)
training = poptorch.trainingModel(model, opts, poptorch.optim.SGD(model.parameters(), lr=0.1))
per_step = []
for x in xs:
    before = faults()
    training(x)
    per_step.append(faults() - before)
ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
for x in xs:  # after the measured steps: the same training in plain torch
    ref_opt.zero_grad()
    reference(x).backward()
    ref_opt.step()
json.dump({"faults": per_step[-16:],
           "max_diff": (model.scale - reference.scale).abs().max().item()}, sys.stdout)
