"""A PopDist program as Graphcore's applications write one (tests/test_popdist.py):
``popdist.init()``, ``popdist.poptorch.Options``, data sharded by instance index, a
checkpoint written once with ``execute_on_instances``. Also imported by the test, which
runs the same training in one process and in plain PyTorch."""
from __future__ import annotations

import json
import pathlib
import sys

import torch

import poptorch

MICRO_BATCH = 2
STEPS = 3
LR = 0.1


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(4, 2)

    def forward(self, x, y):
        out = self.fc(x)
        return out, torch.nn.functional.mse_loss(out, y)


def data(total_replicas: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One global batch per step: MICRO_BATCH rows per replica."""
    g = torch.Generator().manual_seed(1)
    rows = STEPS * MICRO_BATCH * total_replicas
    return torch.randn(rows, 4, generator=g), torch.randn(rows, 2, generator=g)


def train(opts: poptorch.Options, first_replica: int, replicas: int,
          total_replicas: int) -> dict:
    """Train with ``opts``, feeding replicas ``first_replica ..`` of each global batch."""
    model = Model()
    training = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=LR))
    x, y = data(total_replicas)
    step_rows = MICRO_BATCH * total_replicas
    for step in range(STEPS):
        lo = step * step_rows + first_replica * MICRO_BATCH
        hi = lo + replicas * MICRO_BATCH
        training(x[lo:hi], y[lo:hi])
    training.copyWeightsToHost()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def main(out: pathlib.Path) -> None:
    import popdist
    import popdist.poptorch
    assert popdist.isPopdistEnvSet()
    popdist.init()
    opts = popdist.poptorch.Options(ipus_per_replica=1)
    index = popdist.getInstanceIndex()
    facts = {"instances": popdist.getNumInstances(), "index": index,
             "local": popdist.getNumLocalReplicas(), "total": popdist.getNumTotalReplicas(),
             "offset": popdist.getReplicaIndexOffset(),
             "ipus": popdist.getNumIpusPerReplica(),
             "replication_factor": opts.replication_factor,
             "process": [opts.Distributed.processId, opts.Distributed.numProcesses]}
    weights = train(opts, popdist.getReplicaIndexOffset(), popdist.getNumLocalReplicas(),
                    popdist.getNumTotalReplicas())
    torch.save(weights, out / f"weights_{index}.pt")
    ran = popdist.execute_on_instances({0}, lambda: (out / f"ran_on_{index}").touch() or index)
    # after execute_on_instances every instance sees instance 0's file
    facts["saw_checkpoint"] = (out / "ran_on_0").exists()
    facts["returned"] = ran
    popdist.synchronize()
    (out / f"facts_{index}.json").write_text(json.dumps(facts))


if __name__ == "__main__":
    main(pathlib.Path(sys.argv[1]))
