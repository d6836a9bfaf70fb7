"""Buffers are device state across the steps and micro-batches of a call
(``_runtime/program/runner.py`` ``drop_history``): the temporal graph network's
pattern (Graphcore's TGN) writes a buffer in ``forward`` with ``index_put_`` from values
that carry gradients, reads it at the next step, and detaches it on the host only after
each call. On an IPU nothing flows back through the buffer from one step to the next;
the same must hold here, on the eager and the compiled backend.
"""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import poptorch

NODES, FEATURES = 6, 4


class Memory(nn.Module):
    """A node memory updated from the model's own (differentiable) messages."""

    def __init__(self):
        super().__init__()
        self.update = nn.Linear(2 * FEATURES, FEATURES)
        self.head = nn.Linear(FEATURES, 1)
        self.register_buffer("memory", torch.zeros(NODES, FEATURES))

    def forward(self, nodes, features, target):
        previous = self.memory[nodes]  # read: last step's values, no history
        new = torch.tanh(self.update(torch.cat([previous, features], dim=1)))
        self.memory.index_put_((nodes,), new)  # written with gradients flowing in
        out = self.head(new + self.memory[nodes]).squeeze(1)
        return out, F.mse_loss(out, target)


def _batches(count, per_call, seed=0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(count):
        nodes = torch.stack([torch.randperm(NODES, generator=g)[:2] for _ in range(per_call)])
        yield (nodes.reshape(-1), torch.randn(2 * per_call, FEATURES, generator=g),
               torch.randn(2 * per_call, generator=g))


@pytest.mark.parametrize("d,g", [(4, 1), (1, 2), (2, 2)])
@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_a_buffer_written_with_gradients_is_state_between_steps(monkeypatch, backend, d, g):
    monkeypatch.setenv("POPTORCH_TORCH_COMPILE_BACKEND", "aot_eager")
    torch.manual_seed(0)
    model = Memory()
    ref = copy.deepcopy(model)
    opts = poptorch.Options().deviceIterations(d)
    opts.Training.gradientAccumulation(g)
    opts.showCompilationProgressBar(False)
    opts.Jit.backend(backend)
    pop = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.1,
                                                              momentum=0.9))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for nodes, features, target in _batches(5, d * g):
        pop(nodes, features, target)
        model.memory.detach_()  # what TGN's host code does after each call
        for step in range(d):  # plain PyTorch: one micro-batch after the other
            ref_opt.zero_grad()
            for m in range(g):
                k = step * g + m
                rows = slice(2 * k, 2 * k + 2)
                _, loss = ref(nodes[rows], features[rows], target[rows])
                (loss / g).backward()
                ref.memory.detach_()  # state: no history into the next micro-batch
            ref_opt.step()
    for (name, p), r in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, r, rtol=1e-6, atol=1e-6, msg=name)
    torch.testing.assert_close(model.memory, ref.memory, rtol=1e-6, atol=1e-6)
    assert model.memory.grad_fn is None
