"""Models, data and plain-PyTorch references shared by the replicated tensor sharding
tests (tests/test_memory_sharding.py, tests/test_memory_distributed.py) and the program
the latter starts under torchrun (tests/memory_worker.py).

A run has ``R`` global replicas (``r`` per process); each call is one optimizer step on
a global batch of ``R * M`` rows, replica ``k`` taking rows ``k*M .. (k+1)*M``.
"""
from __future__ import annotations

import torch

import poptorch
from poptorch.enums import CommGroupType, VariableRetrievalMode

M = 3                     # rows per micro-batch
FEATURES, HIDDEN, CLASSES = 5, 8, 3
CALLS = 4
LR, WEIGHT_DECAY, LOSS_SCALING, MAX_NORM = 0.05, 0.1, 4.0, 0.3
MIN_ELEMENTS = 10         # fc1.weight (40) and fc2.weight (24) sharded, biases whole


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(FEATURES, HIDDEN)
        self.fc2 = torch.nn.Linear(HIDDEN, CLASSES)

    def forward(self, x, y):
        out = self.fc2(torch.tanh(self.fc1(x)))
        return out, torch.nn.functional.cross_entropy(out, y)


def make_model(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net()


def global_batch(call: int, replicas: int) -> tuple:
    g = torch.Generator().manual_seed(100 + call)
    return (torch.randn(replicas * M, FEATURES, generator=g),
            torch.randint(0, CLASSES, (replicas * M,), generator=g))


def rows(batch: tuple, first_replica: int, replicas: int) -> tuple:
    """The rows of replicas ``first_replica .. first_replica + replicas - 1``."""
    return tuple(t[first_replica * M:(first_replica + replicas) * M] for t in batch)


def options(replicas: int, sharded: bool, min_elements: int = MIN_ELEMENTS,
            off_chip: bool = False) -> poptorch.Options:
    opts = poptorch.Options().replicationFactor(replicas)
    settings = poptorch.TensorLocationSettings()
    if sharded:
        settings.useReplicatedTensorSharding(True)
        settings.minElementsForReplicatedTensorSharding(min_elements)
    if off_chip:
        settings.useOnChipStorage(False)
    opts.TensorLocations.setOptimizerLocation(settings)
    return opts


def adamw(model: torch.nn.Module) -> poptorch.optim.AdamW:
    return poptorch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY,
                                loss_scaling=LOSS_SCALING, max_grad_norm=MAX_NORM)


def train(model: torch.nn.Module, opts: poptorch.Options, optimizer, calls, replicas: int,
          first_replica: int = 0, total_replicas: int | None = None):
    """Train ``model`` on calls ``calls`` of the global batches; returns the executor."""
    total = total_replicas or replicas
    training = poptorch.trainingModel(model, opts, optimizer)
    for call in calls:
        training(*rows(global_batch(call, total), first_replica, replicas))
    return training


def plain_reference(model: torch.nn.Module, calls, replicas: int) -> dict:
    """Plain PyTorch: one AdamW step per global batch (mean loss over all rows, gradients
    clipped to MAX_NORM)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    for call in calls:
        optimizer.zero_grad()
        model(*global_batch(call, replicas))[1].backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        optimizer.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def elementwise_state_bytes(state: dict) -> int:
    """Bytes of the non-scalar tensors of an optimizer state (``optimizer.state`` or a
    sharded step's pieces)."""
    return sum(v.numel() * v.element_size() for entry in state.values()
               for v in entry.values() if isinstance(v, torch.Tensor) and v.dim() > 0)


class Grouped(torch.nn.Module):
    """A weight with one slice per group of replicas (``replicaGrouping``)."""

    def __init__(self, groups: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(7)
        self.W = torch.nn.Parameter(torch.randn(groups, FEATURES, 4, generator=g) * 0.3)

    def forward(self, x):
        z = torch.mm(x, self.W)
        return z, poptorch.identity_loss(z ** 2, reduction="mean")


def grouped_batch(call: int, replicas: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(300 + call)
    return torch.randn(replicas * M, FEATURES, generator=g)


def train_grouped(model: Grouped, replicas: int, sharded: bool, kind: CommGroupType,
                  size: int, first_replica: int = 0, total: int | None = None):
    opts = options(replicas, sharded, min_elements=4)
    optimizer = poptorch.optim.Adam(model.parameters(), lr=0.05)
    training = poptorch.trainingModel(model, opts, optimizer)
    training.W.replicaGrouping(kind, size, VariableRetrievalMode.OnePerGroup)
    total = total or replicas
    for call in range(CALLS):
        x = grouped_batch(call, total)
        training(x[first_replica * M:(first_replica + replicas) * M])
    return training, optimizer


# --- weights / accumulators sharded over processes (FSDP2: memory/fsdp.py) -----------
G = 2  # micro-batches per step (gradientAccumulation) in the weight-sharding cases
KINDS = ("weight", "accumulator", "optimizer")


def location_options(kinds: tuple, rts: bool, off_chip: bool,
                     accumulation: int = G) -> poptorch.Options:
    """One replica per process; ``kinds`` of tensors with RTS and / or off chip."""
    opts = poptorch.Options()
    opts.Training.gradientAccumulation(accumulation)
    for kind in kinds:
        settings = poptorch.TensorLocationSettings()
        if rts:
            settings.useReplicatedTensorSharding(True)
            settings.minElementsForReplicatedTensorSharding(MIN_ELEMENTS)
        if off_chip:
            settings.useOnChipStorage(False)
        getattr(opts.TensorLocations, f"set{kind.capitalize()}Location")(settings)
    return opts


def process_rows(call: int, rank: int, world: int, accumulation: int = G) -> tuple:
    """Process ``rank``'s rows of call ``call``'s global batch (``accumulation``
    micro-batches of M rows per process)."""
    batch = global_batch(call, world * accumulation)
    return rows(batch, rank * accumulation, accumulation)


# --- the same for the execution strategies (memory/step_shards.py) -------------------
STRATEGY_G = 4  # micro-batches per step (2 pipeline stages need at least 3)
_MODES = {"rts": (True, False), "offchip": (False, True), "both": (True, True)}


def strategy_cases() -> dict[str, tuple[tuple, bool, bool, str]]:
    """name -> (kinds, RTS, off chip, backend asked for): each kind with RTS, off chip
    and both; all three with both, eager and compiled; and nothing (the reference)."""
    table = {"plain": ((), False, False, "eager")}
    for kind in KINDS:
        for mode, (rts, off_chip) in _MODES.items():
            table[f"{kind}_{mode}"] = ((kind,), rts, off_chip, "eager")
    table["all_both"] = (KINDS, True, True, "eager")
    table["all_both_compiled"] = (KINDS, True, True, "inductor")
    return table


class Blocks(torch.nn.Module):
    """``n`` blocks of Linear(width, width) + tanh, then a sum-of-squares loss."""

    def __init__(self, n: int = 8, width: int = 16) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(n))

    def forward(self, x):
        for block in self.blocks:
            x = torch.tanh(block(x))
        return x, (x ** 2).mean()


# --- exact arithmetic: checkpoints resumed at other world sizes, bitwise --------------
# Every float operation of these runs is exact (small dyadic numbers), so the order in
# which processes, micro-batches and shards add cannot change a bit: runs at different
# world sizes must agree bitwise, and any resharding mistake (wrong rows, wrong offsets,
# stale state) shows. Three Linear blocks read the same input (their products would
# compound the bits each step needs), their outputs folded onto OUT features by fixed
# 0/1 matrices; weights start at multiples of 1/8, inputs and targets are in {-1, 0, 1},
# the loss is a sum of squares per micro-batch, SGD with lr 2^-4 and momentum 1/2.
EXACT_FEATURES, EXACT_WIDTHS, EXACT_OUT = 5, (6, 7, 3), 3  # 6, 7, 3 rows: uneven shards
EXACT_MICRO = 4            # micro-batches in a global batch: 4 x 1, 2 x 2 or 1 x 4
EXACT_LR, EXACT_MOMENTUM = 2.0 ** -4, 0.5


class Exact(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(EXACT_FEATURES, d)
                                          for d in EXACT_WIDTHS)
        for i, d in enumerate(EXACT_WIDTHS):
            fold = torch.zeros(d, EXACT_OUT)
            fold[torch.arange(d), torch.arange(d) % EXACT_OUT] = 1.0
            self.register_buffer(f"fold{i}", fold)
        g = torch.Generator().manual_seed(11)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randint(-4, 5, p.shape, generator=g).float() / 8)

    def forward(self, x, y):
        out = sum(block(x) @ getattr(self, f"fold{i}")
                  for i, block in enumerate(self.blocks))
        return out, ((out - y) ** 2).sum()


def exact_sgd(model: torch.nn.Module) -> torch.optim.SGD:
    return torch.optim.SGD(model.parameters(), lr=EXACT_LR, momentum=EXACT_MOMENTUM)


def exact_batch(call: int) -> tuple:
    """Call ``call``'s global batch: EXACT_MICRO micro-batches of M rows."""
    g = torch.Generator().manual_seed(200 + call)
    return (torch.randint(-1, 2, (EXACT_MICRO * M, EXACT_FEATURES), generator=g).float(),
            torch.randint(-1, 2, (EXACT_MICRO * M, EXACT_OUT), generator=g).float())


def exact_rows(call: int, rank: int, world: int) -> tuple:
    """Process ``rank``'s micro-batches of call ``call`` (EXACT_MICRO // world each)."""
    per = EXACT_MICRO // world
    return rows(exact_batch(call), rank * per, per)


def exact_options(world: int, rts: bool) -> poptorch.Options:
    """Weights, accumulators and optimizer state with RTS (or nothing), the global
    batch's micro-batches shared out over ``world`` processes."""
    return location_options(KINDS if rts else (), rts, False, EXACT_MICRO // world)


def exact_reference(calls, dtype: torch.dtype = torch.float32) -> list[dict]:
    """Plain PyTorch: each call one SGD step on the mean over the global batch's
    micro-batches of their losses; the weights after each call."""
    model = Exact().to(dtype)
    optimizer = exact_sgd(model)
    after = []
    for call in calls:
        x, y = exact_batch(call)
        optimizer.zero_grad()
        loss = sum(model(x[k * M:(k + 1) * M].to(dtype), y[k * M:(k + 1) * M].to(dtype))[1]
                   for k in range(EXACT_MICRO)) / EXACT_MICRO
        loss.backward()
        optimizer.step()
        after.append({k: v.detach().clone() for k, v in model.named_parameters()})
    return after
