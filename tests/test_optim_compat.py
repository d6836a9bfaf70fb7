"""PopTorch optimizer rules that programs rely on: upstream attribute names, copies,
the device view in state_dict (ipu_state / ipu_param), switching between
poptorch.optim and torch.optim, float16 accumulation and the mean reduction strategy."""
import copy
import logging

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import poptorch


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


def train_plain(model, optimizer, steps):
    for i in range(steps):
        optimizer.zero_grad()
        F.mse_loss(model.fc(data(i)[0]), data(i)[1]).backward()
        optimizer.step()


def test_variable_attributes_upstream_names():
    opt = poptorch.optim.Adam(Net().parameters(), lr=0.1)
    va = opt.variable_attrs
    assert va.isConstant("eps") and "eps" in va._allowed_attributes
    va._variable_attributes = copy.deepcopy(va._allowed_attributes)
    assert not any(va.isConstant(a) for a in va._allowed_attributes)
    va.markAsConstant("eps")
    assert va.isConstant("eps") and not va.isConstant("lr")


def test_shallow_copy_keeps_poptorch_attributes_and_trains_the_same():
    model = Net()
    ref = copy.deepcopy(model)
    opt = poptorch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, loss_scaling=4.0)
    clone = copy.copy(opt)
    assert clone.loss_scaling == 4.0 and clone.max_grad_norm == float("inf")
    assert clone.variable_attrs.isConstant("velocity_scaling")
    training = poptorch.trainingModel(model, optimizer=opt)
    training(*data(0))
    training.setOptimizer(clone)
    for i in range(1, 3):
        training(*data(i))
    training.copyWeightsToHost()
    train_plain(ref, torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9), 3)
    torch.testing.assert_close(model.fc.weight, ref.fc.weight)


def test_state_dict_device_view_round_trip():
    model = Net()
    ref = copy.deepcopy(model)
    opt = poptorch.optim.Adam(model.parameters(), lr=0.1)
    assert opt.state_dict()["ipu_state"] is None  # nothing compiled yet
    training = poptorch.trainingModel(model, optimizer=opt)
    training.compile(*data(0))
    state = opt.state_dict()
    assert set(state["ipu_state"]) == {f"{k}___{i}" for i in range(2)
                                       for k in ("step", "exp_avg", "exp_avg_sq")}
    assert torch.count_nonzero(state["ipu_state"]["exp_avg___0"]) == 0
    assert state["ipu_param"]["lr___group0"].item() == 0.1
    state["ipu_param"]["lr___group0"] = torch.tensor(0.05, dtype=torch.float64)
    del state["ipu_param"]["eps___group0"]  # a missing entry keeps its value
    opt.load_state_dict(state)
    assert "eps___group0" not in opt.state_dict()["ipu_param"]  # as loaded, until used
    for i in range(3):
        training(*data(i))
    training.copyWeightsToHost()
    after = opt.state_dict()
    assert after["ipu_param"]["lr___group0"].item() == 0.05
    assert after["ipu_param"]["eps___group0"].item() == 1e-8
    assert after["ipu_state"]["step___0"].item() == 3
    plain = torch.optim.Adam(ref.parameters(), lr=0.05)
    train_plain(ref, plain, 3)
    torch.testing.assert_close(model.fc.weight, ref.fc.weight)
    torch.testing.assert_close(after["ipu_state"]["exp_avg___0"],
                               plain.state[ref.fc.weight]["exp_avg"])


def test_offline_target_has_no_device_view():
    model = Net()
    opt = poptorch.optim.SGD(model.parameters(), lr=0.1)
    opts = poptorch.Options().useOfflineIpuTarget()
    poptorch.trainingModel(model, opts, optimizer=opt).compile(*data(0))
    state = opt.state_dict()
    assert state["ipu_state"] is None and state["ipu_param"] is None


@pytest.mark.parametrize("first,second", [
    (poptorch.optim.SGD, torch.optim.SGD), (torch.optim.SGD, poptorch.optim.SGD)])
def test_switch_between_poptorch_and_torch_optimizer_of_one_algorithm(first, second):
    model = Net()
    ref = copy.deepcopy(model)
    training = poptorch.trainingModel(model, optimizer=first(model.parameters(), lr=0.1))
    training(*data(0))
    training.setOptimizer(second(model.parameters(), lr=0.05))
    training(*data(1))
    training.copyWeightsToHost()
    plain = torch.optim.SGD(ref.parameters(), lr=0.1)
    train_plain(ref, plain, 1)
    plain.param_groups[0]["lr"] = 0.05
    plain.zero_grad()
    F.mse_loss(ref.fc(data(1)[0]), data(1)[1]).backward()
    plain.step()
    torch.testing.assert_close(model.fc.weight, ref.fc.weight)
    with pytest.raises(poptorch.Error, match="cannot switch"):
        training.setOptimizer(torch.optim.Adam(model.parameters(), lr=0.1))


def test_float16_accumulation_uses_running_mean_strategy():
    opts = poptorch.Options()
    opts.Training.gradientAccumulation(2)
    opts.Training.setMeanAccumulationAndReplicationReductionStrategy(
        poptorch.MeanReductionStrategy.Post)
    model = Net()
    ref = copy.deepcopy(model)
    opt = poptorch.optim.SGD(model.parameters(), lr=0.1, accum_type=torch.float16)
    training = poptorch.trainingModel(model, opts, optimizer=opt)
    x = torch.cat([data(0)[0], data(1)[0]])
    t = torch.cat([data(0)[1], data(1)[1]])
    training(x, t)
    training.copyWeightsToHost()
    assert training.options.Training.meanAccumulationAndReplicationReductionStrategy \
        == poptorch.MeanReductionStrategy.Running
    plain = torch.optim.SGD(ref.parameters(), lr=0.1)
    for i in range(2):
        (F.mse_loss(ref.fc(data(i)[0]), data(i)[1]) / 2).backward()
    plain.step()
    torch.testing.assert_close(model.fc.weight, ref.fc.weight, atol=1e-3, rtol=1e-3)
    # a model compiled with Post cannot take a float16-accumulating optimizer later
    model2 = Net()
    post = poptorch.trainingModel(
        model2, opts.clone(), optimizer=poptorch.optim.SGD(model2.parameters(), lr=0.1))
    post(x, t)
    with pytest.raises(ValueError, match="already compiled"):
        post.setOptimizer(poptorch.optim.SGD(model2.parameters(), lr=0.1,
                                             accum_type=torch.float16))


def test_attributes_added_after_compile_are_reported_once(caplog):
    model = Net()
    opt = poptorch.optim.SGD(model.parameters(), lr=0.1)
    training = poptorch.trainingModel(model, optimizer=opt)
    training(*data(0))
    opt.param_groups[0]["initial_lr_for_test"] = 0.1
    with caplog.at_level(logging.WARNING, logger="poptorch"):
        training.setOptimizer(opt)
        training.setOptimizer(opt)
    hits = [r for r in caplog.records if "initial_lr_for_test" in r.getMessage()]
    assert len(hits) == 1 and "unexpected group 0 attribute" in hits[0].getMessage()
    # once per model: a second model compiled before the attribute appeared warns again
    training.destroy()
    del opt.param_groups[0]["initial_lr_for_test"]
    second = poptorch.trainingModel(model, optimizer=opt)
    second(*data(0))
    opt.param_groups[0]["initial_lr_for_test"] = 0.1
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="poptorch"):
        second.setOptimizer(opt)
    assert ["initial_lr_for_test" in r.getMessage() for r in caplog.records] == [True]


def test_relaxed_attribute_checks_do_not_warn(caplog):
    model = Net()
    opt = poptorch.optim.SGD(model.parameters(), lr=0.1)
    opts = poptorch.Options().relaxOptimizerAttributesChecks()
    training = poptorch.trainingModel(model, opts, optimizer=opt)
    training(*data(0))
    opt.param_groups[0]["initial_lr_for_test"] = 0.1
    opt.extra_for_test = 1
    with caplog.at_level(logging.WARNING, logger="poptorch"):
        training.setOptimizer(opt)
    assert not [r for r in caplog.records if "unexpected" in r.getMessage()]
