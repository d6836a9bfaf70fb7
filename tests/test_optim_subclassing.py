"""Optimizers subclassed from torch.optim / poptorch.optim ones: the subclass's own code
runs in a training model as in a plain PyTorch loop, and the migration warning (PopTorch
ignored such overrides on the IPU) is given once per subclass, never for the library's
own classes or for a new optimizer written on ``torch.optim.Optimizer``."""
import copy
import logging

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import poptorch
from poptorch.optim.subclassing import library_base, warn_if_subclassed

PHRASE = "Poptorch does not run Python optimizer code directly"

LIBRARY = [poptorch.optim.SGD, poptorch.optim.Adam, poptorch.optim.AdamW,
           poptorch.optim.RMSprop, poptorch.optim.LAMB, torch.optim.SGD,
           torch.optim.Adam, torch.optim.AdamW, torch.optim.RMSprop]


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x, target):
        out = self.fc(x)
        return out, F.mse_loss(out, target)


def data(i):
    g = torch.Generator().manual_seed(i)
    return torch.randn(3, 4, generator=g), torch.randn(3, 2, generator=g)


@pytest.mark.parametrize("cls", LIBRARY, ids=lambda c: f"{c.__module__}.{c.__name__}")
def test_library_classes_are_not_subclasses(cls, caplog):
    opt = cls(Net().parameters(), lr=0.01)
    with caplog.at_level(logging.WARNING, logger="poptorch"):
        assert library_base(opt) is None
        assert not warn_if_subclassed(opt)
    assert PHRASE not in caplog.text


@pytest.mark.parametrize("cls", LIBRARY, ids=lambda c: f"{c.__module__}.{c.__name__}")
def test_subclass_warns_once_per_class(cls, caplog):
    sub = type("MySubclass", (cls,), {})
    subsub = type("MyDeeper", (sub,), {})
    with caplog.at_level(logging.WARNING, logger="poptorch"):
        assert library_base(sub(Net().parameters(), lr=0.01)) is cls
        assert library_base(subsub(Net().parameters(), lr=0.01)) is cls
        assert warn_if_subclassed(sub(Net().parameters(), lr=0.01))
        assert not warn_if_subclassed(sub(Net().parameters(), lr=0.02))  # once per class
        assert warn_if_subclassed(subsub(Net().parameters(), lr=0.01))
    records = [r for r in caplog.records if PHRASE in r.getMessage()]
    assert len(records) == 2 and all(r.levelno == logging.WARNING for r in records)
    assert "`MySubclass`" in records[0].getMessage()
    assert cls.__name__ in records[0].getMessage()


def test_new_optimizer_on_the_abstract_base_is_not_a_subclass(caplog):
    class Plain(torch.optim.Optimizer):
        def __init__(self, params):
            super().__init__(params, {"lr": 0.1})

        def step(self, closure=None):
            return None

    with caplog.at_level(logging.WARNING, logger="poptorch"):
        assert library_base(Plain(Net().parameters())) is None
        assert not warn_if_subclassed(Plain(Net().parameters()))
    assert PHRASE not in caplog.text


class HalfStepSGD(torch.optim.SGD):
    """A subclass whose override matters: every update uses half the learning rate."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"] / 2)
        return None


def test_overridden_step_runs_in_a_training_model():
    """What the warning says: the subclass's step() runs, as in a plain loop (and not
    torch.optim.SGD's, which would move twice as far)."""
    torch.manual_seed(0)
    model = Net()
    ref = copy.deepcopy(model)
    plain_sgd = copy.deepcopy(model)
    training = poptorch.trainingModel(model, optimizer=HalfStepSGD(model.parameters(), lr=0.1))
    for i in range(3):
        training(*data(i))
    training.copyWeightsToHost()
    ref_opt = HalfStepSGD(ref.parameters(), lr=0.1)
    sgd = torch.optim.SGD(plain_sgd.parameters(), lr=0.1)
    for i in range(3):
        for m, o in ((ref, ref_opt), (plain_sgd, sgd)):
            o.zero_grad()
            F.mse_loss(m.fc(data(i)[0]), data(i)[1]).backward()
            o.step()
    torch.testing.assert_close(model.fc.weight, ref.fc.weight)
    torch.testing.assert_close(model.fc.bias, ref.fc.bias)
    assert not torch.allclose(model.fc.weight, plain_sgd.fc.weight)
