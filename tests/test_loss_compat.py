"""Which output is the loss (PopTorch's rules) and losses without gradient."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import poptorch


class LossAndAccuracy(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x, target):
        out = self.fc(x)
        accuracy = (out.argmax(-1) == target).float().mean()
        return F.cross_entropy(out, target), accuracy


def test_loss_first_accuracy_last_trains_on_the_loss():
    model = LossAndAccuracy()
    ref = copy.deepcopy(model)
    x, t = torch.randn(6, 4), torch.randint(0, 3, (6,))
    pop = poptorch.trainingModel(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5))
    loss, accuracy = pop(x, t)
    pop.copyWeightsToHost()
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    ref_loss, ref_accuracy = ref(x, t)
    ref_loss.backward()
    opt.step()
    torch.testing.assert_close(loss, ref_loss.detach())
    torch.testing.assert_close(accuracy, ref_accuracy)
    torch.testing.assert_close(model.fc.weight, ref.fc.weight)


class Frozen(nn.Module):
    def __init__(self):
        super().__init__()
        self.unused = nn.Parameter(torch.ones(3))

    def forward(self, x, target):
        return x * 2, F.l1_loss(x * 2, target)


def test_loss_without_gradient_gives_zero_gradients():
    model = Frozen()
    x, t = torch.randn(2, 3), torch.zeros(2, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, weight_decay=0.5)
    pop = poptorch.trainingModel(model, optimizer=opt)
    out, loss = pop(x, t)
    pop.copyWeightsToHost()
    torch.testing.assert_close(out, x * 2)
    torch.testing.assert_close(loss, F.l1_loss(x * 2, t))
    # plain PyTorch with a zero gradient: only the weight decay moves the parameter
    ref = nn.Parameter(torch.ones(3))
    ref.grad = torch.zeros(3)
    torch.optim.SGD([ref], lr=0.1, weight_decay=0.5).step()
    torch.testing.assert_close(model.unused.detach(), ref.detach())


def test_no_scalar_output_names_the_problem():
    class NoLoss(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(3, 3)

        def forward(self, x):
            return self.fc(x), self.fc(x) * 2

    pop = poptorch.trainingModel(NoLoss())
    with pytest.raises(poptorch.Error, match="Couldn't find a loss"):
        pop(torch.randn(2, 3))


def test_training_model_keeps_submodules_the_user_put_in_eval_mode():
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.bn = nn.BatchNorm1d(4)
            self.drop = nn.Dropout(0.5)

        def forward(self, x, t):
            out = self.drop(self.bn(self.fc(x)))
            return out, F.mse_loss(out, t)

    model = Net()
    model.bn.eval()  # frozen statistics
    model.drop.eval()
    ref = copy.deepcopy(model)
    x, t = torch.randn(8, 4), torch.randn(8, 4)
    pop = poptorch.trainingModel(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    out, _ = pop(x, t)
    pop.copyWeightsToHost()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ref_out, loss = ref(x, t)
    loss.backward()
    opt.step()
    torch.testing.assert_close(out, ref_out.detach())  # no dropout, frozen statistics
    torch.testing.assert_close(model.bn.running_mean, ref.bn.running_mean)
    torch.testing.assert_close(model.fc.weight, ref.fc.weight)
    # a model entirely in eval mode is still trained in train mode
    whole = Net().eval()
    pop2 = poptorch.trainingModel(whole)
    pop2(x, t)
    pop2.copyWeightsToHost()
    assert torch.count_nonzero(whole.bn.running_mean) > 0  # BatchNorm ran in train mode


class Record:
    """An output object that carries its loss as an attribute (as a PyTorch Geometric
    ``Data`` that the model fills in)."""

    def __init__(self, out: torch.Tensor, loss: torch.Tensor) -> None:
        self.out, self.loss = out, loss


class FillsARecord(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x, target):
        out = self.fc(x)
        return Record(out, F.cross_entropy(out, target))


def test_an_output_object_with_a_loss_attribute_trains_on_it():
    torch.manual_seed(0)
    model = FillsARecord()
    ref = copy.deepcopy(model)
    x, t = torch.randn(6, 4), torch.randint(0, 3, (6,))
    pop = poptorch.trainingModel(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5))
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for _ in range(3):
        record = pop(x, t)
        opt.zero_grad()
        ref_record = ref(x, t)
        ref_record.loss.backward()
        opt.step()
        torch.testing.assert_close(record.loss, ref_record.loss.detach())
    torch.testing.assert_close(model.fc.weight, ref.fc.weight)
