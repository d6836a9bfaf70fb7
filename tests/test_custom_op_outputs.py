"""``poptorch.custom_op`` outputs follow ``example_outputs``, as upstream's did: a dtype
the op returns differently is converted to the example's (logged once at INFO), a
shape that differs is a ``poptorch.Error`` naming both shapes. Each case is checked
against the op computed directly in plain PyTorch."""
import logging

import pytest
import torch
import torch.nn as nn

import poptorch

NS = "poptorch_outputs_test"


@torch.library.custom_op(f"{NS}::scale_f32", mutates_args=())
def _scale_f32(x: torch.Tensor, alpha: float = 2.0) -> torch.Tensor:
    """Always returns float32, whatever the dtype of ``x``."""
    return x.float() * alpha


@_scale_f32.register_fake
def _(x, alpha=2.0):
    return torch.empty(x.shape, dtype=torch.float32, device=x.device)


def _scale_backward(ctx, grad):
    return grad.to(ctx.dtype) * ctx.alpha, None


def _scale_setup(ctx, inputs, output):
    ctx.dtype, ctx.alpha = inputs[0].dtype, inputs[1]


_scale_f32.register_autograd(_scale_backward, setup_context=_scale_setup)


@torch.library.custom_op(f"{NS}::positives", mutates_args=())
def _positives(x: torch.Tensor) -> torch.Tensor:
    """Row counts of positive entries, int64."""
    return (x > 0).sum(dim=1)


@_positives.register_fake
def _(x):
    return torch.empty(x.shape[:1], dtype=torch.int64, device=x.device)


@torch.library.custom_op(f"{NS}::twice_rows", mutates_args=())
def _twice_rows(x: torch.Tensor) -> torch.Tensor:
    return torch.cat([x, x])


@_twice_rows.register_fake
def _(x):
    return torch.empty((2 * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)


# An operator without a fake kernel (as a C++ op loaded from a library would be):
# custom_op gives it one from example_outputs.
_NOFAKE = torch.library.Library(f"{NS}_nofake", "DEF")
_NOFAKE.define("exp32(Tensor x) -> Tensor")
_NOFAKE.impl("exp32", lambda x: x.float().exp(), "CPU")


def _conversion_logs(caplog, label):
    return [r for r in caplog.records if "converted to" in r.getMessage()
            and label in r.getMessage()]


def test_float_dtype_differing_is_converted_and_logged_once(caplog):
    caplog.set_level(logging.INFO, logger="poptorch::python")
    x = torch.randn(3, 4)
    for _ in range(2):
        (out,) = poptorch.custom_op([x], "scale_f32", NS, 1,
                                    example_outputs=[torch.zeros(3, 4, dtype=torch.half)],
                                    attributes={"alpha": 1.5})
        assert out.dtype == torch.half
        torch.testing.assert_close(out, (x.float() * 1.5).half(), atol=0, rtol=0)
    logs = _conversion_logs(caplog, f"{NS}::scale_f32")
    assert len(logs) == 1 and logs[0].levelno == logging.INFO
    assert "torch.float32" in logs[0].getMessage() and "torch.float16" in logs[0].getMessage()


def test_integer_dtype_differing_is_converted():
    x = torch.randn(5, 6)
    (out,) = poptorch.custom_op(x, "positives", NS, 1,
                                example_outputs=[torch.zeros(5, dtype=torch.int32)])
    assert out.dtype == torch.int32
    assert torch.equal(out, (x > 0).sum(dim=1).to(torch.int32))


def test_converted_output_keeps_its_gradient():
    x = torch.randn(4, 3, requires_grad=True)
    ref_x = x.detach().clone().requires_grad_()
    (out,) = poptorch.custom_op([x], "scale_f32", NS, 1,
                                example_outputs=[torch.zeros(4, 3, dtype=torch.float64)])
    assert out.dtype == torch.float64
    weights = torch.randn(4, 3, dtype=torch.float64)
    (out * weights).sum().backward()
    ((ref_x * 2.0).double() * weights).sum().backward()
    torch.testing.assert_close(out, (ref_x * 2.0).double().detach())
    torch.testing.assert_close(x.grad, ref_x.grad)


def test_shape_differing_is_an_error_naming_both_shapes():
    x = torch.randn(2, 3)
    assert _twice_rows(x).shape == (4, 3)  # what the op returns, computed directly
    with pytest.raises(poptorch.Error, match=r"output 0 of .*twice_rows has shape "
                                             r"\(4, 3\), but example_outputs\[0\] has "
                                             r"shape \(2, 3\)"):
        poptorch.custom_op([x], "twice_rows", NS, 1, example_outputs=[x])


def test_shape_differing_inside_a_compiled_function_is_the_same_error():
    def fn(x):
        return poptorch.custom_op([x], "twice_rows", NS, 1, example_outputs=[x])[0]

    with pytest.raises(poptorch.Error, match=r"has shape \(4, 3\), but example_outputs"
                                             r"\[0\] has shape \(2, 3\)"):
        torch.compile(fn, backend="eager")(torch.randn(2, 3))


def test_compiled_call_converts_the_dtype_as_the_eager_one():
    def fn(x):
        return poptorch.custom_op([x], "scale_f32", NS, 1,
                                  example_outputs=[torch.zeros(x.shape,
                                                               dtype=torch.bfloat16)])[0]

    x = torch.randn(3, 5)
    out = torch.compile(fn, backend="aot_eager", fullgraph=True)(x)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, (x.float() * 2.0).bfloat16(), atol=0, rtol=0)


def test_operator_without_fake_kernel_compiles_with_the_returned_dtype(caplog):
    caplog.set_level(logging.INFO, logger="poptorch::python")

    def fn(x):
        return poptorch.custom_op([x], "exp32", f"{NS}.nofake", 1,
                                  example_outputs=[x.double()])[0] + 1

    x = torch.randn(2, 3)
    expected = x.float().exp().double() + 1  # the op computed directly, then converted
    eager = fn(x)
    assert eager.dtype == torch.float64 and torch.equal(eager, expected)
    assert len(_conversion_logs(caplog, f"{NS}.nofake::exp32")) == 1
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)(x)
    assert compiled.dtype == torch.float64
    torch.testing.assert_close(compiled, expected, atol=0, rtol=0)


class HalfHead(nn.Module):
    """A model whose custom op declares float16 outputs and computes float32 ones (as
    DINO's ExpMovAvg did)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        (out,) = poptorch.custom_op([self.fc(x)], "scale_f32", NS, 1,
                                    example_outputs=[torch.zeros(x.shape[0], 4,
                                                                 dtype=torch.half)])
        return out


def test_model_with_a_converted_output_runs_through_poptorch():
    torch.manual_seed(0)
    model = HalfHead()
    x = torch.randn(8, 4)
    with torch.no_grad():
        expected = (model.fc(x).float() * 2.0).half()
    pop = poptorch.inferenceModel(model)
    for _ in range(2):
        out = pop(x)
        assert out.dtype == torch.half
        torch.testing.assert_close(out, expected, atol=0, rtol=0)
