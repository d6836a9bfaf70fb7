"""A compiled model accepts only inputs like those it was compiled with (PopTorch's
rule): other calls raise poptorch.Error before the model runs; destroy() recompiles."""
import copy
import logging

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import poptorch


class Adder(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(2))
        self.calls = 0

    def forward(self, x, y=None, scale=1, **extra):
        self.calls += 1
        out = x * self.w * scale
        if y is not None:
            out = out + y
        for value in extra.values():
            out = out + value
        return out


def test_same_inputs_run_and_match_plain_pytorch():
    model = Adder()
    pop = poptorch.inferenceModel(model)
    x, y = torch.randn(2), torch.randn(2)
    for _ in range(2):
        torch.testing.assert_close(pop(x, y=y, scale=3), model(x, y=y, scale=3))
    # a dict given in another order is the same input
    nested = poptorch.inferenceModel(DictModel())
    d = {"a": torch.ones(2), "b": torch.full((2,), 2.0)}
    nested(d)
    torch.testing.assert_close(nested({"b": d["b"], "a": d["a"]}), DictModel()(d))


class DictModel(nn.Module):
    def forward(self, d):
        return d["a"] / d["b"]


@pytest.mark.parametrize("call,match", [
    (lambda p, x, y: p(x.long(), y=y, scale=3), "expected torch.float32 but got torch.int64"),
    (lambda p, x, y: p(torch.cat([x, x]), y=y, scale=3),
     r"expected torch.Size\(\[2\]\) but got torch.Size\(\[4\]\)"),
    (lambda p, x, y: p(x, scale=3), "Type mismatch for y: expected torch.Tensor but got None"),
    (lambda p, x, y: p(x, y=y, scale=4), "Value mismatch for scale: expected 3 but got 4"),
    (lambda p, x, y: p(x, y=y, scale=3, z=x), "Unexpected arguments: z"),
])
def test_changed_inputs_raise_before_the_model_runs(call, match):
    model = Adder()
    pop = poptorch.inferenceModel(model)
    x, y = torch.randn(2), torch.randn(2)
    pop(x, y=y, scale=3)
    calls = pop.model.calls
    with pytest.raises(poptorch.Error, match=match) as info:
        call(pop, x, y)
    assert "compiled for the inputs" in str(info.value)
    assert pop.model.calls == calls  # nothing ran


def test_missing_keyword_and_dict_key():
    pop = poptorch.inferenceModel(Adder())
    x = torch.randn(2)
    pop(x, extra_a=x)
    with pytest.raises(poptorch.Error, match="Missing arguments: extra_a"):
        pop(x)
    nested = poptorch.inferenceModel(DictModel())
    nested({"a": torch.ones(2), "b": torch.ones(2)})
    with pytest.raises(poptorch.Error, match="Missing arguments: a"):
        nested({"b": torch.ones(2)})


def test_training_model_is_left_untouched_and_destroy_recompiles():
    model = nn.Linear(3, 1)
    ref = copy.deepcopy(model)

    class WithLoss(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x, t):
            return F.mse_loss(self.inner(x), t)

    pop = poptorch.trainingModel(WithLoss(model),
                                 optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    x, t = torch.randn(4, 3), torch.randn(4, 1)
    pop(x, t)
    pop.copyWeightsToHost()
    before = model.weight.detach().clone()
    with pytest.raises(poptorch.Error, match="Dtype mismatch for t"):
        pop(x, t.double())
    pop.copyWeightsToHost()
    assert torch.equal(model.weight, before)
    pop.destroy()
    x2, t2 = torch.randn(6, 3), torch.randn(6, 1)
    pop(x2, t2)  # compiled again for the new shapes
    pop.copyWeightsToHost()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for xb, tb in ((x, t), (x2, t2)):
        opt.zero_grad()
        F.mse_loss(ref(xb), tb).backward()
        opt.step()
    torch.testing.assert_close(model.weight, ref.weight)


class VarArgs(nn.Module):
    def forward(self, x, *rest):
        for r in rest:
            x = x + r
        return x


def test_positional_count_matters_with_var_args_and_keywords_bind_by_name():
    model = VarArgs()
    pop = poptorch.inferenceModel(model)
    x = torch.randn(2)
    torch.testing.assert_close(pop(x, x, x), model(x, x, x))
    with pytest.raises(poptorch.Error, match="Number of positional arguments mismatch: "
                                             "expected 3 arguments but got 2"):
        pop(x, x)
    # without *args, passing by keyword or by position is the same input
    adder = Adder()
    pop2 = poptorch.inferenceModel(adder)
    y = torch.randn(2)
    pop2(x, y)
    torch.testing.assert_close(pop2(y=y, x=x), adder(x, y))


def test_missing_mandatory_argument_at_compile_time():
    pop = poptorch.inferenceModel(Adder())
    with pytest.raises(poptorch.Error, match="Mandatory parameter x missing"):
        pop()


class Holder:
    def __init__(self, t):
        self.t = t


class TakesObject(nn.Module):
    def forward(self, x, holder):
        return x + holder.t


def test_custom_objects_are_compared_by_type():
    model = TakesObject()
    pop = poptorch.inferenceModel(model)
    x = torch.randn(2)
    pop(x, Holder(torch.ones(2)))
    h = Holder(torch.full((2,), 3.0))
    torch.testing.assert_close(pop(x, h), model(x, h))
    with pytest.raises(poptorch.Error, match="Type mismatch for holder: expected Holder"):
        pop(x, 3)


class Wrapper(nn.Module):
    def forward(self, *args, **kwargs):
        return Adder.forward(self.inner, *args, **kwargs)

    def __init__(self):
        super().__init__()
        self.inner = Adder()


def test_failed_first_call_leaves_the_model_uncompiled():
    model = Wrapper()
    pop = poptorch.inferenceModel(model)
    with pytest.raises(TypeError):
        pop()  # forward itself fails: nothing stays compiled
    assert not pop.isCompiled()
    with pytest.raises(poptorch.Error, match="Model has not been compiled or has been "
                                             "destroyed"):
        pop.copyWeightsToHost()
    x = torch.randn(2)
    torch.testing.assert_close(pop(x, scale=2), model(x, scale=2))
    pop.destroy()
    with pytest.raises(poptorch.Error, match="has been destroyed"):
        pop.copyWeightsToDevice()


def test_inputs_requiring_grad_are_detached_so_recurrent_state_trains():
    torch.manual_seed(0)
    rnn = nn.RNN(4, 3, batch_first=True)
    ref = copy.deepcopy(rnn)

    class WithLoss(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x, h):
            out, h_next = self.inner(x, h)
            return h_next, out.pow(2).mean()

    pop = poptorch.trainingModel(WithLoss(rnn),
                                 optimizer=torch.optim.SGD(rnn.parameters(), lr=0.1))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    h_pop = h_ref = torch.randn(1, 2, 3)
    for _step in range(3):
        x = torch.randn(2, 5, 4)
        # h from plain PyTorch carries a graph through weights updated since
        h_cpu_graph = rnn(x, h_pop)[1]
        h_pop, _ = pop(x, h_cpu_graph)
        ref_opt.zero_grad()
        out, h_next = ref(x, ref(x, h_ref)[1].detach())
        out.pow(2).mean().backward()
        ref_opt.step()
        h_ref = h_next.detach()
        torch.testing.assert_close(h_pop, h_ref)
    pop.copyWeightsToHost()
    torch.testing.assert_close(rnn.weight_hh_l0, ref.weight_hh_l0)


def test_weight_copies_of_a_loaded_model_before_its_first_call(tmp_path):
    model = nn.Linear(3, 2)
    pop = poptorch.inferenceModel(model)
    x = torch.randn(2, 3)
    pop.compileAndExport(str(tmp_path / "m.poptorch"), x)
    loaded = poptorch.load(str(tmp_path / "m.poptorch"))
    loaded.copyWeightsToHost()  # nothing ran yet: nothing to copy, no error
    loaded.copyWeightsToDevice()
    torch.testing.assert_close(loaded(x), model(x))


def test_inputs_requiring_grad_are_detached_with_one_warning_per_model(caplog):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    x = torch.randn(4, 3, requires_grad=True)
    warnings = lambda: [r for r in caplog.records  # noqa: E731
                        if "Input tensor has requires_grad=True set" in r.getMessage()]
    with caplog.at_level(logging.WARNING, logger="poptorch"):
        first = poptorch.inferenceModel(model)
        out = first(x)
        first(x)
        assert len(warnings()) == 1
        second = poptorch.inferenceModel(model)  # another model warns again
        second(x)
        assert len(warnings()) == 2
    assert not out.requires_grad and torch.equal(out, model(x.detach()))
    assert x.grad is None
