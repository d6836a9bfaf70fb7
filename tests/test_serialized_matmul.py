"""serializedMatMul (ops/matmul.py): every mode and factor, batched and broadcast
operands, forward and gradients against torch.matmul; and no temporary of the output's
size (checked on the tensors each operator creates, not by timing)."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import poptorch

Mode = poptorch.MatMulSerializationMode
MODES = [Mode.InputChannels, Mode.ReducingDim, Mode.OutputChannels]
SHAPES = [((8, 12), (12, 4)),            # 2-D
          ((2, 8, 12), (12, 4)),         # batched lhs, 2-D rhs (folded)
          ((8, 12), (3, 12, 4)),         # 2-D lhs, batched rhs (broadcast gradient)
          ((2, 1, 8, 12), (3, 12, 4)),   # broadcast batch dimensions
          ((2, 8, 12), (2, 12, 4))]      # same batch


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("factor", [1, 4])
@pytest.mark.parametrize("shapes", SHAPES)
def test_forward_and_gradients_equal_matmul(mode, factor, shapes):
    torch.manual_seed(0)
    a = torch.randn(*shapes[0], dtype=torch.float64, requires_grad=True)
    b = torch.randn(*shapes[1], dtype=torch.float64, requires_grad=True)
    ra, rb = a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    out = poptorch.serializedMatMul(a, b, mode, factor)
    ref = torch.matmul(ra, rb)
    torch.testing.assert_close(out, ref)
    g = torch.randn_like(ref)
    out.backward(g)
    ref.backward(g)
    torch.testing.assert_close(a.grad, ra.grad)
    torch.testing.assert_close(b.grad, rb.grad)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_within_tolerance(dtype):
    a, b = torch.randn(8, 16).to(dtype), torch.randn(16, 8).to(dtype)
    for mode in MODES:
        out = poptorch.serializedMatMul(a, b, mode, 4)
        assert out.dtype == dtype
        torch.testing.assert_close(out.float(), a.float() @ b.float(), rtol=2e-2,
                                   atol=5e-2)


class LargestNew(TorchDispatchMode):
    """The largest number of elements of a tensor created by any operator."""

    def __init__(self):
        super().__init__()
        self.sizes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.__name__
        if isinstance(out, torch.Tensor) and not name.endswith("_") and \
                out.untyped_storage().data_ptr() not in self.inputs:
            self.sizes.append((name, out.numel()))
        return out


@pytest.mark.parametrize("mode", MODES)
def test_training_creates_only_outputs_and_gradients(mode):
    a = torch.randn(16, 64, requires_grad=True)
    b = torch.randn(64, 16, requires_grad=True)
    rec = LargestNew()
    rec.inputs = {a.untyped_storage().data_ptr(), b.untyped_storage().data_ptr()}
    with rec:
        out = poptorch.serializedMatMul(a, b, mode, 4)
        out.backward(torch.ones(16, 16))
    big = [(n, s) for n, s in rec.sizes if s > 16 * 64 // 4]
    # Only the output and the two gradients are full size (plus the gradient of
    # ones given to backward); no partial product of the output's size.
    names = sorted(n.split(".")[0] for n, _ in big)
    assert names.count("empty") + names.count("empty_like") <= 3, big
    assert "cat" not in names and "add" not in names and "mm" not in names, big


def test_errors_are_clear():
    a, b = torch.randn(4, 6), torch.randn(6, 4)
    with pytest.raises(poptorch.Error, match="same dtype"):
        poptorch.serializedMatMul(a, b.half(), Mode.ReducingDim, 2)
    with pytest.raises(poptorch.Error, match="cannot be multiplied"):
        poptorch.serializedMatMul(a, a, Mode.ReducingDim, 2)
    with pytest.raises(poptorch.Error, match="do not broadcast"):
        poptorch.serializedMatMul(torch.randn(2, 4, 6), torch.randn(3, 6, 4),
                                  Mode.ReducingDim, 2)
    with pytest.raises(poptorch.Error, match="floating-point"):
        poptorch.serializedMatMul(a.long(), b.long(), Mode.ReducingDim, 2)
