"""float16 / bfloat16 rules of a PopTorch model (user guide "Half / float16 support";
facts from upstream's half_float_test.py and half_test.py), against plain PyTorch with
the casts written out: ``_runtime/casting.py`` and ``halfFloatCasting``."""
import pytest
import torch
import torch.nn.functional as F

import poptorch

LOW = [torch.float16, torch.bfloat16]
Cast = poptorch.HalfFloatCastingBehavior


def layer_and_input(conv):
    torch.manual_seed(42)
    if conv:
        return torch.nn.Conv1d(4, 5, 2), torch.randn(1, 4, 4)
    return torch.nn.Linear(10, 20), torch.randn(3, 10)


def by_hand(layer, x, dtype):
    """The layer computed in ``dtype`` with its weights cast by hand."""
    w, b = layer.weight.to(dtype), layer.bias.to(dtype)
    if isinstance(layer, torch.nn.Conv1d):
        return F.conv1d(x.to(dtype), w, b)
    return F.linear(x.to(dtype), w, b)


@pytest.mark.parametrize("conv", [True, False])
@pytest.mark.parametrize("low", LOW)
def test_activations_decide_the_precision_of_weighted_layers(conv, low):
    layer, x = layer_and_input(conv)
    # float32 activations, float32 weights
    out = poptorch.inferenceModel(layer)(x)
    assert out.dtype == torch.float32 and torch.equal(out, layer(x))
    # low-precision activations, float32 weights: computed in low precision
    out = poptorch.inferenceModel(layer)(x.to(low))
    assert out.dtype == low and torch.equal(out, by_hand(layer, x, low))
    # float32 activations, low-precision weights: computed in float32
    layer.to(low)
    out = poptorch.inferenceModel(layer)(x)
    assert out.dtype == torch.float32 and torch.equal(out, by_hand(layer, x, torch.float32))
    # low activations, low weights: plain PyTorch
    out = poptorch.inferenceModel(layer)(x.to(low))
    assert out.dtype == low and torch.equal(out, layer(x.to(low)))


def test_mixed_activations_follow_pytorch_promotion():
    class Adder(torch.nn.Module):
        def forward(self, x, y):
            return x + y
    t1, t2 = torch.tensor([1.0]).half(), torch.tensor([2.0])
    assert poptorch.inferenceModel(Adder())(t1, t2).dtype == torch.float32
    assert poptorch.inferenceModel(Adder())(t2, t1).dtype == torch.float32


def test_casts_inside_the_model_decide_too():
    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(1, 1)

        def forward(self, x):
            return self.linear(x.half()), self.linear(x.float()), self.linear(x.bfloat16())
    model = Model()
    x = torch.tensor([[3]], dtype=torch.uint8)
    half, flt, bf = poptorch.inferenceModel(model)(x)
    assert half.dtype == torch.float16 and flt.dtype == torch.float32
    assert bf.dtype == torch.bfloat16
    assert torch.equal(half, by_hand(model.linear, x.half(), torch.float16))
    assert torch.equal(flt, model.linear(x.float()))


def test_buffers_follow_activations_too():
    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("b", torch.randn(3, 3))

        def forward(self, x):
            return torch.matmul(self.b, x)
    model = Model()
    x = torch.randn(3, 3).half()
    out = poptorch.inferenceModel(model)(x)
    assert out.dtype == torch.float16 and torch.equal(out, model.b.half() @ x)


class Regressor(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(10, 10)

    def forward(self, data, target):
        out = self.linear(data)
        return out, F.mse_loss(out, target)


@pytest.mark.parametrize("low", LOW)
def test_float32_master_weights_train_from_low_precision_inputs(low):
    torch.manual_seed(42)
    model = Regressor()
    ref = Regressor()
    ref.load_state_dict(model.state_dict())
    x, target = torch.randn(4, 10).to(low), torch.randn(4, 10).to(low)
    pm = poptorch.trainingModel(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(3):
        out, loss = pm(x, target)
        ref_opt.zero_grad()
        r_out = F.linear(x, ref.linear.weight.to(low), ref.linear.bias.to(low))
        r_loss = F.mse_loss(r_out, target)
        r_loss.backward()
        ref_opt.step()
        assert out.dtype == low and torch.equal(out, r_out.detach())
        assert torch.equal(loss, r_loss.detach())
    assert model.linear.weight.dtype == torch.float32
    assert torch.equal(model.linear.weight, ref.linear.weight)


def test_master_weight_training_converges():
    torch.manual_seed(42)
    model = Regressor()
    target = torch.randn(1, 10)
    x = torch.randn(1, 10).half()
    opts = poptorch.Options().deviceIterations(50)
    pm = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.1))
    with torch.no_grad():
        first_loss = F.mse_loss(model.linear(x.float()), target)
    for _ in range(3):
        out, loss = pm(x.repeat(50, 1), target.half().repeat(50, 1))
    assert first_loss > 0.1 and loss.float() < 1e-3
    torch.testing.assert_close(out.float(), target, rtol=1e-2, atol=1e-2)


def test_float32_model_with_float32_inputs_runs_without_the_casting_mode():
    seen = []

    class Probe(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(2, 2)

        def forward(self, x):
            seen.append(torch._C._len_torch_function_stack())
            return self.linear(x)
    pm = poptorch.inferenceModel(Probe())
    for _ in range(3):
        pm(torch.randn(1, 2))
    # The first call decides (plus the first call's check of overlap markers, one more
    # mode); nothing to cast, so no mode afterwards.
    assert seen == [2, 0, 0]
    pm = poptorch.inferenceModel(pm.model)  # float16 inputs: casts, so the mode stays
    pm(torch.randn(1, 2).half())
    pm(torch.randn(1, 2).half())
    assert seen[3:] == [2, 1]


@pytest.mark.parametrize("low", LOW)
def test_float_downcast_to_half_casts_every_mixed_operation(low):
    class Model(torch.nn.Module):
        def forward(self, x, y):
            return x + y
    opts = poptorch.Options()
    opts.Precision.halfFloatCasting(Cast.FloatDowncastToHalf)
    x, y = torch.randn(3).half(), torch.randn(3)
    out = poptorch.inferenceModel(Model(), opts)(x, y)
    assert out.dtype == torch.float16 and torch.equal(out, x + y.half())


def test_half_upcast_to_float_computes_weighted_layers_in_float():
    layer, x = layer_and_input(conv=False)
    opts = poptorch.Options()
    opts.Precision.halfFloatCasting(Cast.HalfUpcastToFloat)
    out = poptorch.inferenceModel(layer, opts)(x.half())
    assert out.dtype == torch.float32 and torch.equal(out, layer(x.half().float()))


class TwoStage(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(4, 4)
        self.b = torch.nn.Linear(4, 4)

    def forward(self, x):
        with poptorch.Block(ipu_id=0):
            h = torch.tanh(self.a(x))
        with poptorch.Block(ipu_id=1):
            return self.b(h)


@pytest.mark.parametrize("autocast", [False, True])
def test_pipelined_stages_apply_the_rules_in_their_worker_threads(autocast):
    torch.manual_seed(3)
    model = TwoStage()
    if autocast:
        model.b.autocast()  # only the second stage, and the input is float32
    opts = poptorch.Options().deviceIterations(2)
    x = torch.randn(4, 4)
    out = poptorch.inferenceModel(model, opts)(x if autocast else x.half())
    low = torch.float16
    h = torch.tanh(by_hand(model.a, x, torch.float32 if autocast else low))
    expected = by_hand(model.b, h, low)
    assert out.dtype == low and torch.equal(out, expected)


def test_guide_half_inference_snippet():
    # The guide's "How to run a model using half precision" (inference_half).
    model = torch.nn.Linear(1, 10)
    model.half()
    t1 = torch.tensor([1.]).half()
    opts = poptorch.Options()
    inference_model = poptorch.inferenceModel(model, opts)
    out = inference_model(t1)
    assert out.dtype == torch.half
    assert torch.equal(out, model(t1))
    # Option 2 of the guide: float32 weights, float16 input.
    model.float()
    out = poptorch.inferenceModel(model, opts.clone())(t1)
    assert out.dtype == torch.half and torch.equal(out, by_hand(model, t1, torch.half))
