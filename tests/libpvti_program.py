"""A program instrumented with libpvti as Graphcore's PopVision tutorial does
(tests/test_libpvti.py runs it with PVTI_OPTIONS set)."""
import json
import sys

import torch

import libpvti as pvti
import poptorch

channel = pvti.createTraceChannel("App")
events = pvti.createTraceChannel("Instant Events")
loss_graph = pvti.Graph("Loss", "")
training_loss = loss_graph.addSeries("Training Loss")
accuracy = pvti.Graph("Accuracy", "%").addSeries("Validation Accuracy")
heatmap = pvti.HeatmapDouble("weights", [-1.0, 0.0, 1.0], "x")


@pvti.Tracepoint(channel, "decorated")
def work(model, x, y):
    with pvti.Tracepoint(channel, "inner"):
        return model(x, y)


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(3, 2)

    def forward(self, x, y):
        out = self.fc(x)
        return out, torch.nn.functional.mse_loss(out, y)


torch.manual_seed(0)
model = Model()
training = poptorch.trainingModel(model, poptorch.Options(),
                                  torch.optim.SGD(model.parameters(), lr=0.1))
losses, weights = [], []
for epoch in range(2):
    pvti.Tracepoint.event(events, f"Epoch {epoch} begin")
    with pvti.Tracepoint(channel, f"Epoch:{epoch}"):
        _, loss = work(training, torch.randn(4, 3), torch.randn(4, 2))
        losses.append(float(loss))
        training_loss.add(float(loss))
        training.copyWeightsToHost()
        w = model.fc.weight.detach().flatten().tolist()
        weights.append(w)
        heatmap.add(w)
accuracy.add(torch.tensor(50.0))
json.dump({"enabled": pvti.isEnabled(), "losses": losses, "weights": weights},
          open(sys.argv[1], "w"))
