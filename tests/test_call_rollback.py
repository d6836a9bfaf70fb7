"""A failing training call leaves the weights and the optimizer state as they were, also
when the executor keeps no copy of them (a call of one optimizer step over several
micro-batches: nothing is updated before every micro-batch has succeeded)."""
import copy

import pytest
import torch
import torch.nn.functional as F

import poptorch


class FailsOnMarkedRows(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(3, 2)

    def forward(self, x, t):
        if bool((x[:, 0] == 1000).any()):
            raise ValueError("bad row")
        return F.mse_loss(self.fc(x), t)


def test_failing_micro_batch_of_one_step_leaves_weights_and_momentum():
    model = FailsOnMarkedRows()
    reference = copy.deepcopy(model.fc)
    options = poptorch.Options()
    options.Training.gradientAccumulation(4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    pop = poptorch.trainingModel(model, options, optimizer=opt)
    torch.manual_seed(1)
    for step in range(3):
        x, t = torch.randn(8, 3), torch.randn(8, 2)
        if step == 1:
            x[7, 0] = 1000  # the last micro-batch of the step fails
            with pytest.raises(ValueError, match="bad row"):
                pop(x, t)
            continue
        pop(x, t)
        ref_opt.zero_grad()
        for i in range(4):
            (F.mse_loss(reference(x[2 * i:2 * i + 2]), t[2 * i:2 * i + 2]) / 4).backward()
        ref_opt.step()
    assert pop._program.plan.device_iterations == 1 and pop._program.plan.factor == 4
    pop.copyWeightsToHost()
    for p, q in zip(model.fc.parameters(), reference.parameters(), strict=True):
        assert (p.detach() - q.detach()).abs().max() <= 1e-6
