"""Pipelined model through poptorch.trainingModel / inferenceModel vs plain PyTorch."""
import copy

import torch

import poptorch


class TwoStage(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(6, 6)
        self.b = torch.nn.Linear(6, 6)

    def forward(self, x, y):
        with poptorch.Block("0", ipu_id=0):
            x = torch.tanh(self.a(x))
        with poptorch.Block("1", ipu_id=1):
            x = self.b(x)
        return x, ((x - y)**2).mean()


def test_training_model_pipeline_matches_pytorch():
    model = TwoStage()
    reference = copy.deepcopy(model)
    opts = poptorch.Options()
    opts.Training.gradientAccumulation(4)
    training = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.1))
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    torch.manual_seed(3)
    for _ in range(3):
        x, y = torch.randn(12, 6), torch.randn(12, 6)
        training(x, y)
        ref_opt.zero_grad()
        for i in range(4):
            (reference(x[3 * i:3 * i + 3], y[3 * i:3 * i + 3])[1] / 4).backward()
        ref_opt.step()
    for p, q in zip(model.parameters(), reference.parameters(), strict=False):
        assert (p.detach() - q.detach()).abs().max() <= 1e-5


def test_inference_model_pipeline_matches_pytorch():
    model = TwoStage().eval()
    opts = poptorch.Options()
    opts.deviceIterations(2)
    inference = poptorch.inferenceModel(model, opts)
    x, y = torch.randn(4, 6), torch.randn(4, 6)
    out, _ = inference(x, y)
    with torch.no_grad():
        ref = torch.cat([model(x[:2], y[:2])[0], model(x[2:], y[2:])[0]])
    assert torch.allclose(out, ref, atol=1e-6)
