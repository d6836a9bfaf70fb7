"""Plain tensor attributes are constants of the compiled program (PopTorch's rule);
buffers keep their state across calls."""
import torch
import torch.nn as nn

import poptorch


class Accumulate(nn.Module):
    def __init__(self, as_buffer):
        super().__init__()
        if as_buffer:
            self.register_buffer("total", torch.zeros(2))
        else:
            self.total = torch.zeros(2)
        self.mask = torch.tensor([1.0, 0.0])  # a constant never changed

    def forward(self, x):
        self.total += x
        return self.total * self.mask + x


def test_plain_tensor_attribute_restarts_from_its_compiled_value():
    model = Accumulate(as_buffer=False)
    pop = poptorch.inferenceModel(model)
    x = torch.tensor([1.0, 2.0])
    outs = [pop(x) for _ in range(3)]
    fresh = Accumulate(as_buffer=False)
    expected = fresh(x)  # every call = plain PyTorch on the compiled value
    for out in outs:
        torch.testing.assert_close(out, expected)
    torch.testing.assert_close(model.total, x)  # the first call (the trace) showed once
    mask = pop._model.mask
    pop(x)
    assert pop._model.mask is mask  # unchanged constants are not copied


def test_buffer_keeps_state_across_calls():
    model = Accumulate(as_buffer=True)
    ref = Accumulate(as_buffer=True)
    pop = poptorch.inferenceModel(model)
    x = torch.tensor([1.0, 2.0])
    for _ in range(3):
        torch.testing.assert_close(pop(x), ref(x))
    pop.copyWeightsToHost()
    torch.testing.assert_close(model.total, ref.total)
