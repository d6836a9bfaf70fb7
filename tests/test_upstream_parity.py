"""Behaviours matched to upstream PopTorch 3.4 (each checked against plain PyTorch, or
for a refusal, the error's class and message):

* a training model without ``identity_loss`` whose torch.nn losses do not form one final
  loss: "Multiple independent losses found in graph";
* ``backward()`` on a model's output: a ``poptorch.Error``;
* a replica-grouped parameter's optimizer state in ``ipu_state``: one value per group;
* ``useOfflineIpuTarget``: the model compiles but does not run (``AssertionError``);
  ``poptorch.load`` of its file runs;
* ``dynamic_slice`` at a tensor start in a model: the size must divide the dimension;
* ``copyNamedBuffersToDevice`` without ``updatableNamedBuffers``: a ``poptorch.Error``;
* ``cond`` / ``for_loop`` in a training model: "only supported in inference";
* one ``trainingModel`` per module until ``model.destroy()`` (or ``destroy()`` on the
  wrapper): "Model has already been wrapped in 'poptorch.trainingModel'".
"""
from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn.functional as F

import poptorch


# ------------------------------------------------------------- one final loss
class TwoLosses(torch.nn.Module):
    def __init__(self, wrap: bool) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(6, 4)
        self.wrap = wrap

    def forward(self, x, target):
        out = F.log_softmax(self.lin(x), dim=1)
        total = F.nll_loss(out, target) + F.nll_loss(out, target) * 5.0
        if self.wrap:
            total = poptorch.identity_loss(total, reduction="mean")
        return out, total


def _data():
    torch.manual_seed(0)
    return torch.randn(3, 6), torch.tensor([1, 0, 3])


def test_two_independent_losses_are_refused():
    x, t = _data()
    model = TwoLosses(wrap=False)
    before = copy.deepcopy(model.state_dict())
    training = poptorch.trainingModel(model, optimizer=torch.optim.SGD(model.parameters(), 0.1))
    with pytest.raises(poptorch.Error, match="Multiple independent losses found in graph. "
                       "Graph must have one final loss. Wrap final graph loss in "
                       r"poptorch.identity_loss.*NllLoss"):
        training(x, t)
    for name, value in model.state_dict().items():  # nothing was trained
        assert torch.equal(value, before[name])


def test_the_same_losses_wrapped_in_identity_loss_train_as_pytorch():
    x, t = _data()
    model = TwoLosses(wrap=True)
    ref = copy.deepcopy(model)
    training = poptorch.trainingModel(model, optimizer=torch.optim.SGD(model.parameters(), 0.1))
    _, loss = training(x, t)
    ref_opt = torch.optim.SGD(ref.parameters(), 0.1)
    _, ref_loss = ref(x, t)
    ref_loss.backward()
    ref_opt.step()
    torch.testing.assert_close(loss, ref_loss.detach())
    torch.testing.assert_close(model.lin.weight, ref.lin.weight)


def test_a_loss_computed_from_another_loss_is_one_final_loss():
    class Chained(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(6, 4)

        def forward(self, x, target):
            out = self.lin(x)
            first = F.mse_loss(out, target)
            # the second loss is computed from the first: one final loss
            return out, F.mse_loss(out * first, target)

    x, target = torch.randn(3, 6), torch.randn(3, 4)
    model = Chained()
    ref = copy.deepcopy(model)
    _, loss = poptorch.trainingModel(model)(x, target)
    torch.testing.assert_close(loss, ref(x, target)[1].detach())


# ------------------------------------------------------------------- backward()
@pytest.mark.parametrize("training", [True, False])
def test_backward_on_a_models_output_is_refused(training):
    class WithLoss(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(3, 2)

        def forward(self, x):
            out = self.lin(x)
            return out, out.sum()

    x = torch.randn(2, 3)
    plain_out, plain_loss = WithLoss()(x)
    plain_loss.backward()  # plain PyTorch: allowed
    model = WithLoss()
    wrapped = poptorch.trainingModel(model) if training else poptorch.inferenceModel(model)
    for _ in range(3):  # the first call, then the per-call fast path
        out, loss = wrapped(x)
        for tensor in (out, loss):
            with pytest.raises(poptorch.Error, match=r"backward\(\) cannot be called "
                               "explicitly on outputs of a PopTorch model"):
                tensor.backward()


def test_an_input_returned_as_it_is_keeps_its_backward():
    class Echo(torch.nn.Module):
        def forward(self, x):
            return x

    x = torch.ones(2)
    assert poptorch.inferenceModel(Echo())(x) is x
    assert "backward" not in x.__dict__


# ------------------------------------------------------- replica-grouped state
def test_replica_grouped_optimizer_state_has_one_value_per_group():
    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.W = torch.nn.Parameter(torch.randn(4, 6))

        def forward(self, x):
            z = x @ self.W
            return z, poptorch.identity_loss(z ** 2, reduction="mean")

    model = Model()
    optimizer = poptorch.optim.AdamW(model.parameters(), 0.1)
    opts = poptorch.Options()
    opts.replication_factor = 4
    training = poptorch.trainingModel(model, opts, optimizer=optimizer)
    training.W.replicaGrouping(poptorch.CommGroupType.NoGrouping, 0,
                               poptorch.VariableRetrievalMode.OnePerGroup)
    training(torch.randn(4, 6))
    state = optimizer.state_dict()["ipu_state"]
    assert state["step___0"].tolist() == [1.0] * 4
    assert state["exp_avg___0"].shape == state["exp_avg_sq___0"].shape == (4, 6)
    # and a round trip keeps the step
    optimizer.load_state_dict(optimizer.state_dict())
    assert float(optimizer.state[model.W]["step"]) == 1.0


# ------------------------------------------------------------- offline target
class Add(torch.nn.Module):
    def forward(self, x, y):
        return x + y


def test_a_model_for_an_offline_ipu_compiles_but_does_not_run(tmp_path):
    opts = poptorch.Options().useOfflineIpuTarget()
    assert opts.connection_type == poptorch.ConnectionType.Never.value
    model = poptorch.inferenceModel(Add(), opts)
    x, y = torch.ones(2), torch.arange(2.0)
    with pytest.raises(AssertionError, match="Trying to run a model on an offline device") \
            as info:
        model(x, y)
    assert isinstance(info.value, poptorch.Error)
    path = str(tmp_path / "add.poptorch")
    model.compileAndExport(path, x, y)
    with pytest.raises(AssertionError, match="Trying to attach to an offline device"):
        model.attachToDevice()
    loaded = poptorch.load(path)  # as upstream: the loaded model runs
    assert not loaded.options.exists("ipu_version")
    assert torch.equal(loaded(x, y), x + y)


class AddLinear(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(2, 2)

    def forward(self, x, y):
        return self.fc(x) + y


def test_an_offline_model_does_not_run_after_compile_and_export(tmp_path, monkeypatch):
    """``compileAndExport`` runs a compiling model's first calls to compile it (a
    compiled program is what the file holds); what those calls leave behind (the
    per-call fast path among it) does not make an offline model runnable."""
    monkeypatch.setenv("POPTORCH_TORCH_COMPILE_BACKEND", "aot_eager")  # (quick to compile)
    torch.manual_seed(0)
    opts = poptorch.Options().useOfflineIpuTarget()
    opts.Jit.backend("inductor")
    model = poptorch.inferenceModel(AddLinear(), opts)
    x, y = torch.ones(2, 2), torch.arange(4.0).reshape(2, 2)
    model.compileAndExport(str(tmp_path / "lin.poptorch"), x, y)
    for _ in range(2):
        with pytest.raises(AssertionError, match="Trying to run a model on an offline"):
            model(x, y)
    loaded = poptorch.load(str(tmp_path / "lin.poptorch"))
    reference = AddLinear()
    reference.load_state_dict(model.model.state_dict())
    assert torch.equal(loaded(x, y), reference(x, y))


# ---------------------------------------------------------------- dynamic_slice
def test_dynamic_slice_size_must_divide_the_dimension_in_a_model():
    t = torch.arange(8.0)
    start = torch.tensor([1])

    class Slice(torch.nn.Module):
        def forward(self, t, start):
            return poptorch.dynamic_slice(t, 0, start, 7, 1)

    # outside a PopTorch model it is PyTorch's slice
    assert torch.equal(Slice()(t, start), t[1:8])
    with pytest.raises(poptorch.Error, match=r"The size of the slice \(7\) must be a factor "
                       r"of the slicing dimension \(8\)\."):
        poptorch.inferenceModel(Slice())(t, start)

    class Fits(torch.nn.Module):
        def forward(self, t, start):
            return poptorch.dynamic_slice(t, 0, start, 4, 2)

    assert torch.equal(poptorch.inferenceModel(Fits())(t, start), t[1:5:2])


# ---------------------------------------------------------------- named buffers
def test_copy_named_buffers_without_the_option_is_refused():
    class Buffers(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("b", torch.ones(1))

        def forward(self, x):
            return x + self.b

    model = poptorch.inferenceModel(Buffers())
    x = torch.ones(2)
    assert torch.equal(model(x), x + 1)
    with pytest.raises(poptorch.Error, match="No named buffers marked as updatable via "
                       "updatableNamedBuffers option"):
        model.copyNamedBuffersToDevice()


# ------------------------------------------------------------- cond / for_loop
class Controlled(torch.nn.Module):
    def __init__(self, op: str) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.op = op

    def forward(self, condition, x):
        if self.op == "cond":
            out = poptorch.cond(condition, self.lin, [x], self.lin, [x])[0]
        else:
            out = poptorch.for_loop(2, self.lin, [x])[0]
        return out, poptorch.identity_loss(out, reduction="sum")


@pytest.mark.parametrize("op", ["cond", "for_loop"])
def test_control_flow_is_for_inference_only(op):
    condition, x = torch.tensor([True]), torch.ones(1, 4)
    model = Controlled(op)
    plain_out, _ = model(condition, x)  # plain PyTorch runs it, in training too
    out, _ = poptorch.inferenceModel(model)(condition, x)
    torch.testing.assert_close(out, plain_out)
    training = poptorch.trainingModel(Controlled(op))
    with pytest.raises(poptorch.Error,
                       match=rf"poptorch.{op}\(\) is only supported in inference"):
        training(condition, x)


# ----------------------------------------------------- one training wrapper per module
class Regress(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 2)

    def forward(self, x, target):
        out = self.lin(x)
        return out, F.mse_loss(out, target)


def _regress_data(step: int):
    g = torch.Generator().manual_seed(step)
    return torch.randn(4, 3, generator=g), torch.randn(4, 2, generator=g)


def _plain_steps(ref: torch.nn.Module, opt: torch.optim.Optimizer, steps) -> None:
    """The reference: plain PyTorch SGD steps (PopTorch's default optimizer is
    SGD(lr=0.01))."""
    for step in steps:
        opt.zero_grad()
        ref(*_regress_data(step))[1].backward()
        opt.step()


_WRAPPED = r"Model has already been wrapped in 'poptorch.trainingModel'\. Call " \
    r"model\.destroy\(\) on the model to unwrap before wrapping again\."


def test_a_module_has_one_training_wrapper_until_model_destroy():
    model = Regress()
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.01)
    training = poptorch.trainingModel(model)
    training(*_regress_data(0))
    _plain_steps(ref, ref_opt, [0])
    torch.testing.assert_close(model.lin.weight, ref.lin.weight)
    # upstream's refusal: a RuntimeError that is also a poptorch.Error
    with pytest.raises(RuntimeError, match=_WRAPPED) as info:
        poptorch.trainingModel(model)
    assert isinstance(info.value, poptorch.Error)
    with pytest.raises(poptorch.Error, match=_WRAPPED):
        poptorch.trainingModel(training)  # (the wrapper stands for its module)
    # inference wrappers are not limited, and share the trained weights
    x, target = _regress_data(5)
    out, _ = poptorch.inferenceModel(model)(x, target)
    torch.testing.assert_close(out, ref.lin(x).detach())
    training(*_regress_data(1))  # the refusals changed nothing
    _plain_steps(ref, ref_opt, [1])
    torch.testing.assert_close(model.lin.weight, ref.lin.weight)
    model.destroy()  # destroys the wrapper and unwraps the module
    assert not training.isCompiled()
    assert "destroy" not in vars(model)
    again = poptorch.trainingModel(model)
    again(*_regress_data(2))
    _plain_steps(ref, ref_opt, [2])
    torch.testing.assert_close(model.lin.weight, ref.lin.weight)
    torch.testing.assert_close(model.lin.bias, ref.lin.bias)


def test_destroy_on_the_wrapper_releases_its_module():
    model = Regress()
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.01)
    training = poptorch.trainingModel(model)
    training(*_regress_data(0))
    training.destroy()
    assert not hasattr(model, "destroy")
    rewrapped = poptorch.trainingModel(training)  # wraps the same module again
    rewrapped(*_regress_data(1))
    _plain_steps(ref, ref_opt, [0, 1])
    torch.testing.assert_close(model.lin.weight, ref.lin.weight)
    with pytest.raises(poptorch.Error, match=_WRAPPED):
        poptorch.trainingModel(model)


def test_a_wrapper_the_program_no_longer_holds_does_not_count():
    model = Regress()
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.01)
    poptorch.trainingModel(model)(*_regress_data(0))  # (the wrapper is not kept)
    training = poptorch.trainingModel(model)  # allowed: nothing reaches the first
    training = None
    training = poptorch.trainingModel(model)  # nor the second
    training(*_regress_data(1))
    _plain_steps(ref, ref_opt, [0, 1])
    torch.testing.assert_close(model.lin.weight, ref.lin.weight)


def test_a_failed_first_call_keeps_the_module_wrapped():
    model = Regress()
    training = poptorch.trainingModel(model)
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        training(torch.randn(4, 5), torch.randn(4, 2))  # (plain PyTorch's error)
    with pytest.raises(poptorch.Error, match=_WRAPPED):
        poptorch.trainingModel(model)
    training(*_regress_data(0))  # the wrapper still works with good inputs


def test_copies_of_a_wrapped_module_are_not_wrapped():
    model = Regress()
    training = poptorch.trainingModel(model)
    training(*_regress_data(0))
    twin = copy.deepcopy(model)
    twin.destroy()  # a copy's destroy() does nothing ...
    assert training.isCompiled()
    ref = copy.deepcopy(twin)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.01)
    poptorch.trainingModel(twin)(*_regress_data(1))  # ... and the copy may be wrapped
    _plain_steps(ref, ref_opt, [1])
    torch.testing.assert_close(twin.lin.weight, ref.lin.weight)
    buffer = io.BytesIO()
    torch.save(model, buffer)  # a pickle of the module loads without its wrapper
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    loaded.destroy()
    assert training.isCompiled()
    torch.testing.assert_close(loaded.lin.weight, model.lin.weight)


def test_a_modules_own_destroy_is_kept():
    class WithDestroy(Regress):
        def __init__(self) -> None:
            super().__init__()
            self.destroyed = 0

        def destroy(self) -> None:
            self.destroyed += 1

    model = WithDestroy()
    training = poptorch.trainingModel(model)
    training(*_regress_data(0))
    model.destroy()  # the module's own method
    assert model.destroyed == 1 and training.isCompiled()
    with pytest.raises(poptorch.Error, match=_WRAPPED):
        poptorch.trainingModel(model)
    training.destroy()
    poptorch.trainingModel(model)


def test_modules_that_compare_equal_are_limited_one_by_one():
    class Compared(Regress):
        def __eq__(self, other: object) -> bool:
            return isinstance(other, Compared)

        def __hash__(self) -> int:
            return 0

    model = Compared()
    ref = copy.deepcopy(model)
    training = poptorch.trainingModel(model)
    training(*_regress_data(0))
    with pytest.raises(poptorch.Error, match=_WRAPPED):
        poptorch.trainingModel(model)
    equal = copy.deepcopy(ref)
    assert equal == model
    poptorch.trainingModel(equal)  # another module, though equal: allowed
    model.destroy()
    poptorch.trainingModel(model)(*_regress_data(1))
    _plain_steps(ref, torch.optim.SGD(ref.parameters(), lr=0.01), [0, 1])
    torch.testing.assert_close(model.lin.weight, ref.lin.weight)
