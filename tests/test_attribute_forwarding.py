"""An attribute the executor lacks is read from the user's model, private ones included.

As upstream's ``PoplarExecutor.__getattr__``: tools that walk a model (a summary such
as ``torchinfo.summary(poptorch_model)``, ``apply`` to initialise it) work on the
executor as on the model. A name neither has raises an ``AttributeError`` naming both;
the executor's own state still resolves normally.
"""
import copy

import pytest
import torch
from torch import nn

import poptorch
from poptorch.executor.poplar_executor import PoplarExecutor


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3)
        self.block = nn.Sequential(nn.Flatten(), nn.Linear(4 * 4 * 4, 8), nn.ReLU())
        self.head = nn.Linear(8, 3)
        self.head.weight.requires_grad_(False)
        self._cache_note = "private, on the model"

    def forward(self, x, target=None):
        out = self.head(self.block(self.conv(x)))
        if target is None:
            return out
        return out, nn.functional.cross_entropy(out, target)


def wrapped(training=False):
    torch.manual_seed(0)
    model = Net()
    if training:
        return model, poptorch.trainingModel(
            model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    return model, poptorch.inferenceModel(model)


def summary_rows(model):
    """The rows a summary tool such as torchinfo builds without a forward pass: walk
    ``named_children`` from the top, count each module's parameters (trainable or
    not), note leaf modules and kernel sizes (``hasattr`` probing)."""
    rows = []

    def walk(name, module, depth):
        params = list(module.named_parameters())
        rows.append((depth, name, type(module).__name__,
                     sum(p.numel() for _, p in params),
                     sum(p.numel() for _, p in params if p.requires_grad),
                     not any(module.children()),
                     tuple(module.kernel_size) if hasattr(module, "kernel_size") else None))
        for child_name, child in module.named_children():
            walk(child_name, child, depth + 1)

    walk("", model, 0)
    return rows


@pytest.mark.parametrize("training", [False, True])
def test_private_module_tables_and_walks_are_the_models(training):
    model, pop = wrapped(training)
    assert pop._modules is model._modules
    assert pop._parameters is model._parameters
    assert pop._cache_note == "private, on the model"
    assert [(n, m) for n, m in pop.named_modules()] == list(model.named_modules())
    assert [(n, m) for n, m in pop.named_children()] == list(model.named_children())
    assert summary_rows(pop)[1:] == summary_rows(model)[1:]  # the top row: class name
    assert summary_rows(pop)[0][3:] == summary_rows(model)[0][3:]


def test_a_summary_with_forward_hooks_through_the_executor_matches_plain_pytorch():
    # torchinfo's forward pass: hooks on every submodule (found through the object it
    # was given), then one call; the executor runs the user's submodules.
    def record(pop_or_model, x):
        shapes, handles = [], []
        for name, module in pop_or_model.named_modules():
            if name:
                handles.append(module.register_forward_hook(
                    lambda m, args, out, name=name: shapes.append(
                        (name, tuple(args[0].shape), tuple(out.shape)))))
        out = pop_or_model(x)
        for handle in handles:
            handle.remove()
        return shapes, out

    model, pop = wrapped()
    reference = copy.deepcopy(model).eval()
    x = torch.randn(2, 1, 6, 6)
    got, out = record(pop, x)
    expected, ref_out = record(reference, x)
    assert got == expected and len(got) == 6
    assert torch.allclose(out, ref_out, atol=1e-6)


def test_apply_through_the_executor_initialises_the_models_weights():
    model, pop = wrapped(training=True)
    reference = copy.deepcopy(model)

    def init(module):
        if isinstance(module, nn.Linear):
            nn.init.constant_(module.bias, 0.25)

    assert pop.apply(init) is model  # as upstream: the model's own apply
    reference.apply(init)
    x, y = torch.randn(2, 1, 6, 6), torch.tensor([0, 2])
    _, loss = pop(x, y)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    _, ref_loss = reference(x, y)
    ref_loss.backward()
    ref_opt.step()
    assert torch.allclose(loss, ref_loss.detach(), atol=1e-6)
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert torch.allclose(p, q, atol=1e-6), name


def test_a_name_neither_has_raises_an_error_naming_both():
    _, pop = wrapped()
    with pytest.raises(AttributeError) as info:
        pop.no_such_thing  # noqa: B018 (the read is the test)
    message = str(info.value)
    assert "'PoplarExecutor'" in message and "'Net'" in message
    assert "'no_such_thing'" in message
    assert not hasattr(pop, "_compield")  # a misspelt state attribute is not read silently
    assert getattr(pop, "kernel_size", "absent") == "absent"  # probing works


def test_the_executors_own_state_resolves_on_the_executor():
    model, pop = wrapped()
    model._options = "the model's"  # same names as the executor's state
    model._compiled = "the model's"
    assert isinstance(pop._options, poptorch.Options)
    assert pop._compiled is None  # not compiled yet: the executor's, not the model's
    pop(torch.randn(2, 1, 6, 6))
    assert pop._compiled is not None and pop._compiled != "the model's"


def test_no_forwarding_while_the_executor_is_built_or_copied():
    bare = PoplarExecutor.__new__(PoplarExecutor)  # as unpickling starts
    with pytest.raises(AttributeError, match="_user_model"):
        bare._user_model  # noqa: B018 (the read is the test)
    with pytest.raises(AttributeError):
        bare.anything  # noqa: B018 (no recursion through the missing state)
    _, pop = wrapped()
    # copy / pickle probe dunders on the instance: they are not the model's
    assert not hasattr(pop, "__deepcopy__") and not hasattr(pop, "__setstate__")
    clone = copy.copy(pop)
    assert type(clone) is PoplarExecutor and clone._user_model is pop._user_model


def test_an_attribute_error_inside_a_property_of_the_executor_is_not_forwarded(
        monkeypatch):
    model, pop = wrapped()
    model.rng_state = "the model's"  # same name as the executor's property

    def broken(self):
        raise AttributeError("inner failure")

    monkeypatch.setattr(PoplarExecutor, "rng_state", property(broken))
    with pytest.raises(AttributeError, match="inner failure"):
        pop.rng_state  # noqa: B018 (the read is the test)
