"""Models, data and the plain-PyTorch reference shared by the multi-process tests
(tests/test_distributed.py) and the program they start under torchrun
(tests/distributed_worker.py).

A run has ``R`` global replicas: ``r`` per process on ``P`` processes; global replica
``p * r + j`` is local replica ``j`` of process ``p``. One call consumes
``D x G x R x M`` rows, laid out ``[d][g][replica][m]``; process ``p`` gets the rows of
its replicas, in the same order.
"""
from __future__ import annotations

import itertools

import torch

import poptorch

D, G, M = 2, 2, 3          # device iterations, gradient accumulation, rows per micro-batch
FEATURES, CLASSES = 5, 3
CALLS = 3                  # calls (of D optimizer steps each) per run


class Net(torch.nn.Module):
    """A tiny classifier returning (output, loss); ``batchnorm`` adds running stats."""

    def __init__(self, batchnorm: bool = False) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(FEATURES, 8)
        self.norm = torch.nn.BatchNorm1d(8) if batchnorm else torch.nn.Identity()
        self.fc2 = torch.nn.Linear(8, CLASSES)

    def forward(self, x, y):
        out = self.fc2(torch.tanh(self.norm(self.fc1(x))))
        return out, torch.nn.functional.cross_entropy(out, y)


class Branchy(torch.nn.Module):
    """Uses head ``a`` for micro-batches whose first feature is positive, head ``b``
    otherwise: which parameters get gradients changes from micro-batch to micro-batch."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(FEATURES, CLASSES)
        self.b = torch.nn.Linear(FEATURES, CLASSES)

    def forward(self, x, y):
        out = self.a(x) if x[0, 0] > 0 else self.b(x)
        return out, torch.nn.functional.cross_entropy(out, y)


def branchy_batch(call: int, replicas: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A global batch where accumulation step 0 uses head a and the last one head b,
    on every replica (head a is unused in the last micro-batch of every step)."""
    x, y = global_batch(call, replicas)
    x[..., 0] = x[..., 0].abs() + 0.1
    x[:, G - 1, :, :, 0] *= -1
    return x, y


def make_model(seed: int, batchnorm: bool = False) -> Net:
    torch.manual_seed(seed)
    return Net(batchnorm)


def train_configs() -> list[dict]:
    """Local replicas x reduction x optimizer (the issue's grid), plus poptorch.optim loss
    scaling with both mean reduction strategies."""
    grid = [{"r": r, "reduction": red, "optimizer": opt} for r, red, opt in
            itertools.product((1, 2), ("Mean", "Sum"), ("SGD", "Adam"))]
    return grid + [
        {"r": 2, "reduction": "Mean", "optimizer": "SGD", "loss_scaling": 64.0,
         "mean_strategy": "Running"},
        {"r": 1, "reduction": "Mean", "optimizer": "Adam", "loss_scaling": 64.0,
         "mean_strategy": "Post"},
    ]


def config_id(cfg: dict) -> str:
    extra = "".join(f"_{key}{cfg[key]}" for key in ("loss_scaling", "mean_strategy")
                    if key in cfg)
    return f"r{cfg['r']}_{cfg['reduction']}_{cfg['optimizer']}{extra}"


def global_batch(call: int, replicas: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of one call for ``replicas`` global replicas: ([D,G,R,M,F], [D,G,R,M])."""
    g = torch.Generator().manual_seed(100 + call)
    x = torch.randn(D, G, replicas, M, FEATURES, generator=g)
    y = torch.randint(0, CLASSES, (D, G, replicas, M), generator=g)
    return x, y


def process_rows(batch: tuple, rank: int, r: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Process ``rank``'s rows of a global batch (its ``r`` replicas), flattened."""
    x, y = batch
    x = x[:, :, rank * r:(rank + 1) * r].reshape(-1, FEATURES)
    y = y[:, :, rank * r:(rank + 1) * r].reshape(-1)
    return x, y


def poptorch_optimizer(name: str, params, loss_scaling: float | None = None):
    scaling = {} if loss_scaling is None else {"loss_scaling": loss_scaling}
    if name == "SGD":
        return poptorch.optim.SGD(params, lr=0.1, momentum=0.9, **scaling)
    return poptorch.optim.Adam(params, lr=0.01, **scaling)


def torch_optimizer(name: str, params):
    if name == "SGD":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.Adam(params, lr=0.01)


def options(r: int, reduction: str = "Mean", **extra) -> poptorch.Options:
    opts = poptorch.Options().deviceIterations(D).replicationFactor(r)
    opts.Training.gradientAccumulation(G)
    opts.Training.accumulationAndReplicationReductionType(
        getattr(poptorch.ReductionType, reduction))
    opts.showCompilationProgressBar(False)
    if "broadcast_buffers" in extra:
        opts.broadcastBuffers(extra["broadcast_buffers"])
    if "mean_strategy" in extra:
        opts.Training.setMeanAccumulationAndReplicationReductionStrategy(
            getattr(poptorch.MeanReductionStrategy, extra["mean_strategy"]))
    return opts


def run_poptorch(model: Net, cfg: dict, rank: int, first_call: int = 0,
                 calls: int = CALLS, optimizer=None):
    """Train ``model`` for ``calls`` calls as process ``rank`` with ``cfg['r']`` local
    replicas of ``cfg['r'] * processes`` global ones; returns (executor, losses)."""
    r, world = cfg["r"], cfg.get("processes", 1)
    optimizer = optimizer or poptorch_optimizer(cfg["optimizer"], model.parameters(),
                                                cfg.get("loss_scaling"))
    extra = {"mean_strategy": cfg["mean_strategy"]} if "mean_strategy" in cfg else {}
    training = poptorch.trainingModel(model, options(r, cfg["reduction"], **extra),
                                      optimizer)
    losses = []
    for call in range(first_call, first_call + calls):
        _, loss = training(*process_rows(global_batch(call, r * world), rank, r))
        losses.append(loss.detach().clone())
    return training, losses


def plain_reference(model: torch.nn.Module, cfg: dict, replicas: int, calls: int = CALLS,
                    first_call: int = 0, optimizer=None,
                    batches=None) -> torch.optim.Optimizer:
    """The same training as a plain PyTorch loop over all replicas' micro-batches: one
    optimizer step per device iteration on the Mean / Sum of the G x R micro-batch
    losses."""
    optimizer = optimizer or torch_optimizer(cfg["optimizer"], model.parameters())
    batches = batches or global_batch
    for call in range(first_call, first_call + calls):
        x, y = batches(call, replicas)
        for d in range(D):
            optimizer.zero_grad()
            losses = [model(x[d, g, k], y[d, g, k])[1]
                      for g in range(G) for k in range(replicas)]
            total = torch.stack(losses).sum()
            if cfg["reduction"] == "Mean":
                total = total / len(losses)
            total.backward()
            optimizer.step()
    return optimizer


class Grouped(torch.nn.Module):
    """A 2-D weight ``W`` to be replica-grouped: the parameter holds one slice per group."""

    def __init__(self, groups: int) -> None:
        super().__init__()
        self.W = torch.nn.Parameter(torch.randn(groups, FEATURES, CLASSES,
                                                generator=torch.Generator().manual_seed(5)))

    def forward(self, x):
        z = torch.mm(x, self.W)
        return z, poptorch.identity_loss(z ** 2, reduction="mean")


def grouped_batch(call: int, replicas: int) -> torch.Tensor:
    """[replicas, M, F]: one micro-batch per replica (D = G = 1)."""
    return torch.randn(replicas, M, FEATURES, generator=torch.Generator().manual_seed(call))


def grouped_reference(kind: str, replicas: int, size: int) -> torch.Tensor:
    """Plain PyTorch: the mean of the replicas' losses, replica k using its group's slice
    of W (Consecutive: k // size, Orthogonal: k % (replicas // size))."""
    w = torch.nn.Parameter(Grouped(replicas // size).W.detach().clone())
    optimizer = torch.optim.SGD([w], lr=0.05)
    for call in range(CALLS):
        x = grouped_batch(call, replicas)
        optimizer.zero_grad()
        group = (lambda k: k // size) if kind == "Consecutive" else (
            lambda k: k % (replicas // size))
        torch.stack([(torch.mm(x[k], w[group(k)]) ** 2).mean()
                     for k in range(replicas)]).mean().backward()
        optimizer.step()
    return w.detach()


PIPELINE_G = 4  # >= 2 x stages - 1 for a 2-stage training pipeline


def model_parallel_strategies() -> dict:
    """The four execution strategies over blocks "0" and "1" (one per virtual IPU)."""
    def phases():
        return [poptorch.Phase(poptorch.Stage(block)) for block in ("0", "1")]
    return {"pipelined": poptorch.PipelinedExecution(),
            "sharded": poptorch.ShardedExecution(),
            "serial_phased": poptorch.SerialPhasedExecution(*phases()),
            "parallel_phased": poptorch.ParallelPhasedExecution(*phases())}


def pipeline_batch(call: int, replicas: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[G, R, M, F] rows for deviceIterations 1, gradientAccumulation PIPELINE_G."""
    g = torch.Generator().manual_seed(200 + call)
    return (torch.randn(PIPELINE_G, replicas, M, FEATURES, generator=g),
            torch.randint(0, CLASSES, (PIPELINE_G, replicas, M), generator=g))


def pipeline_reference(model: Net, replicas: int) -> None:
    """Plain PyTorch: one SGD step per call on the mean of all micro-batch losses."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for call in range(CALLS):
        x, y = pipeline_batch(call, replicas)
        optimizer.zero_grad()
        torch.stack([model(x[g, k], y[g, k])[1] for g in range(PIPELINE_G)
                     for k in range(replicas)]).mean().backward()
        optimizer.step()
