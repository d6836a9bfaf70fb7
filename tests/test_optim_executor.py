"""poptorch.optim (and torch.optim) through trainingModel: trajectories against plain
PyTorch loops, setOptimizer, constant attributes, loss scaling, checkpoints and the
user-guide example (seed 004)."""
import io
import logging

import pytest
import torch
import torch.nn.functional as F

import poptorch

TOL = 1e-6


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(4, 8)
        self.fc2 = torch.nn.Linear(8, 2)

    def forward(self, x, target):
        out = self.fc2(torch.tanh(self.fc1(x)))
        return out, F.mse_loss(out, target)


def make_net():
    torch.manual_seed(0)
    return Net()


def batch(i, rows=8):
    g = torch.Generator().manual_seed(10 + i)
    return torch.randn(rows, 4, generator=g), torch.randn(rows, 2, generator=g)


def plain_steps(model, opt, batches):
    for x, y in batches:
        opt.zero_grad()
        model(x, y)[1].backward()
        opt.step()


def assert_close_models(a, b, tol=TOL):
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=False):
        assert (p.detach() - q.detach()).abs().max().item() <= tol, name


OPTIMIZERS = [
    (poptorch.optim.SGD, torch.optim.SGD, dict(lr=0.1, momentum=0.9, weight_decay=0.01)),
    (poptorch.optim.SGD, torch.optim.SGD, dict(lr=0.1, momentum=0.9)),
    (poptorch.optim.Adam, torch.optim.Adam, dict(lr=0.01)),
    (poptorch.optim.AdamW, torch.optim.AdamW, dict(lr=0.01, weight_decay=0.1)),
    (poptorch.optim.RMSprop, torch.optim.RMSprop, dict(lr=0.01, momentum=0.5)),
    (torch.optim.SGD, torch.optim.SGD, dict(lr=0.1, momentum=0.9)),
    (torch.optim.Adam, torch.optim.Adam, dict(lr=0.01)),
    (torch.optim.AdamW, torch.optim.AdamW, dict(lr=0.01)),
    (torch.optim.RMSprop, torch.optim.RMSprop, dict(lr=0.01, centered=True)),
]


@pytest.mark.parametrize("ours,theirs,kwargs", OPTIMIZERS)
def test_training_model_matches_plain_loop(ours, theirs, kwargs):
    model, ref = make_net(), make_net()
    opts = poptorch.Options().deviceIterations(2)
    training = poptorch.trainingModel(model, opts, ours(model.parameters(), **kwargs))
    ref_opt = theirs(ref.parameters(), **kwargs)
    for call in range(5):
        steps = [batch(2 * call), batch(2 * call + 1)]
        x = torch.cat([s[0] for s in steps])
        y = torch.cat([s[1] for s in steps])
        training(x, y)
        plain_steps(ref, ref_opt, steps)
    training.copyWeightsToHost()
    assert_close_models(model, ref)


def test_set_optimizer_applies_new_lr_without_recompiling():
    model, ref = make_net(), make_net()
    opt = poptorch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    training = poptorch.trainingModel(model, optimizer=opt)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for i in range(3):
        training(*batch(i))
    plain_steps(ref, ref_opt, [batch(i) for i in range(3)])
    compiled = training._program  # internal: the compiled program object
    for group in opt.param_groups:
        group["lr"] = 0.01
    training.setOptimizer(opt)
    for group in ref_opt.param_groups:
        group["lr"] = 0.01
    for i in range(3, 6):
        training(*batch(i))
    plain_steps(ref, ref_opt, [batch(i) for i in range(3, 6)])
    assert training._program is compiled
    training.copyWeightsToHost()
    assert_close_models(model, ref)


def test_set_optimizer_constant_attribute_error():
    model = make_net()
    training = poptorch.trainingModel(
        model, optimizer=poptorch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    training(*batch(0))
    with pytest.raises(poptorch.Error) as info:
        training.setOptimizer(poptorch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9,
                                                 dampening=0.5))
    assert "'dampening'" in info.value.message and "relaxOptimizerAttributesChecks" in \
        info.value.message
    # Marked variable before compiling: the change is accepted.
    model2 = make_net()
    opt2 = poptorch.optim.SGD(model2.parameters(), lr=0.1, momentum=0.9)
    opt2.variable_attrs.markAsVariable("dampening")
    training2 = poptorch.trainingModel(model2, optimizer=opt2)
    training2(*batch(0))
    training2.setOptimizer(poptorch.optim.SGD(model2.parameters(), lr=0.1, momentum=0.9,
                                              dampening=0.5))


def test_torch_optimizer_default_attribute_is_constant():
    model = make_net()
    training = poptorch.trainingModel(
        model, optimizer=torch.optim.AdamW(model.parameters(), lr=0.01))
    training(*batch(0))
    training.setOptimizer(torch.optim.AdamW(model.parameters(), lr=0.001))  # lr: variable
    with pytest.raises(poptorch.Error, match="'eps'"):
        training.setOptimizer(torch.optim.AdamW(model.parameters(), lr=0.001, eps=1e-3))


def test_relaxed_checks_warn_and_apply(caplog):
    model, ref = make_net(), make_net()
    opts = poptorch.Options().relaxOptimizerAttributesChecks()
    training = poptorch.trainingModel(
        model, opts, poptorch.optim.SGD(model.parameters(), lr=0.1))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    training(*batch(0))
    plain_steps(ref, ref_opt, [batch(0)])
    with caplog.at_level(logging.WARNING, logger="poptorch"):
        training.setOptimizer(poptorch.optim.SGD(model.parameters(), lr=0.1,
                                                 weight_decay=0.5))
    assert "'weight_decay'" in caplog.text
    ref_opt.param_groups[0]["weight_decay"] = 0.5
    for i in range(1, 4):
        training(*batch(i))
    plain_steps(ref, ref_opt, [batch(i) for i in range(1, 4)])
    training.copyWeightsToHost()
    assert_close_models(model, ref)


def test_static_loss_scaling_keeps_trajectory():
    model, ref = make_net(), make_net()
    training = poptorch.trainingModel(
        model, optimizer=poptorch.optim.Adam(model.parameters(), lr=0.01, loss_scaling=256.0))
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    for i in range(6):
        training(*batch(i))
    plain_steps(ref, ref_opt, [batch(i) for i in range(6)])
    training.copyWeightsToHost()
    assert_close_models(model, ref)


def test_automatic_loss_scaling_skips_overflowing_step():
    model, ref = make_net(), make_net()
    opts = poptorch.Options()
    opts.Training.setAutomaticLossScaling(True)
    training = poptorch.trainingModel(
        model, opts, poptorch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9,
                                        loss_scaling=128.0))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    good = [batch(i) for i in range(4)]
    training(*good[0])
    training(*good[1])
    x, y = batch(99)
    x[0, 0] = float("inf")  # the gradients of this step overflow
    training(x, y)
    training(*good[2])
    training(*good[3])
    plain_steps(ref, ref_opt, good)
    training.copyWeightsToHost()
    assert_close_models(model, ref)


def test_checkpoint_through_executor_is_bitwise():
    def fresh():
        model = make_net()
        opt = poptorch.optim.Adam(model.parameters(), lr=0.01,
                                  first_order_momentum_accum_type=torch.float16)
        return model, opt, poptorch.trainingModel(model, optimizer=opt)

    straight, _, straight_training = fresh()
    for i in range(8):
        straight_training(*batch(i))
    straight_training.copyWeightsToHost()

    model, opt, training = fresh()
    for i in range(4):
        training(*batch(i))
    buffer = io.BytesIO()
    torch.save({"model": training.state_dict(), "optim": opt.state_dict()}, buffer)
    assert opt.state_dict()["state"][0]["exp_avg"].dtype == torch.float16
    buffer.seek(0)
    saved = torch.load(buffer)

    model2, opt2, training2 = fresh()
    model2.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["optim"])
    for i in range(4, 8):
        training2(*batch(i))
    training2.copyWeightsToHost()
    for a, b in zip(straight.parameters(), model2.parameters(), strict=False):
        assert torch.equal(a, b)


# --- the user-guide example (seed 004), unchanged -------------------------------------

class ExampleDataset(torch.utils.data.Dataset):
    def __init__(self, shape, length):
        g = torch.Generator().manual_seed(0)
        self.x = torch.rand(length, *shape, generator=g)
        self.y = 2.0 * self.x + 0.5

    def __len__(self):
        return len(self.x)

    def __getitem__(self, index):
        return self.x[index], self.y[index]


class ExampleModelWithLoss(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(1, 1)
        self.loss = torch.nn.MSELoss()

    def forward(self, x, target):
        out = self.fc(x)
        return out, self.loss(out, target)


def test_user_guide_example_seed_004():
    losses = []
    set_optimizer_calls = 0

    # ---- the example, as in the user guide ----
    opts = poptorch.Options()
    opts.deviceIterations(10)
    training_data = poptorch.DataLoader(options=opts,
                                        dataset=ExampleDataset(shape=[1], length=20000),
                                        batch_size=10,
                                        shuffle=True,
                                        drop_last=True)

    model = ExampleModelWithLoss()
    model.train()

    optimizer = torch.optim.AdamW(model.parameters(), lr=0.001)

    poptorch_model = poptorch.trainingModel(model, options=opts, optimizer=optimizer)

    momentum_loss = None

    for batch_, target in training_data:
        _, loss = poptorch_model(batch_, target)

        if momentum_loss is None:
            momentum_loss = loss
        else:
            momentum_loss = momentum_loss * 0.95 + loss * 0.05

        if momentum_loss < 0.1:
            poptorch_model.setOptimizer(torch.optim.AdamW(model.parameters(), lr=0.0001))
            set_optimizer_calls += 1  # (test bookkeeping)
        losses.append(float(loss))  # (test bookkeeping)
    # ---- end of the example ----

    assert len(losses) == 20000 // (10 * 10)
    assert sum(losses[-10:]) / 10 < 0.1 * (sum(losses[:10]) / 10)
    assert set_optimizer_calls > 0
    assert poptorch_model._optimizer.param_groups[0]["lr"] == 0.0001


@pytest.mark.parametrize("tf_variant", [False, True])
def test_rmsprop_without_momentum_keeps_its_momentum_buffer_current(tf_variant):
    # ipu_state holds a momentum buffer from compile on; with momentum 0 it holds the
    # last update (as PopTorch's accumulator) and the trajectory stays torch's
    model, ref = make_net(), make_net()
    opt = poptorch.optim.RMSprop(model.parameters(), lr=0.01, momentum=0.0,
                                 use_tf_variant=tf_variant)
    pop = poptorch.trainingModel(model, optimizer=opt)
    for i in range(3):
        before = [p.detach().clone() for p in model.parameters()]
        pop(*batch(i))
    pop.copyWeightsToHost()
    state = opt.state_dict()["ipu_state"]
    for k, (p, old) in enumerate(zip(model.parameters(), before, strict=False)):
        update = (old - p.detach()) / (1.0 if tf_variant else 0.01)
        torch.testing.assert_close(state[f"momentum_buffer___{k}"], update,
                                   rtol=1e-4, atol=1e-6)
    if not tf_variant:
        plain_steps(ref, torch.optim.RMSprop(ref.parameters(), lr=0.01),
                    [batch(i) for i in range(3)])
        assert_close_models(model, ref)
