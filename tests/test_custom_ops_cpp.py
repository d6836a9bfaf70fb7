"""A custom op written in C++ (tests/custom_ops/scaled_cube.cpp), built at test time with
torch.utils.cpp_extension, loaded the way PopTorch users loaded custom op libraries
(``ctypes.cdll.LoadLibrary``), called through ``poptorch.custom_op`` with attributes of
every type, trained inside trainingModel with deviceIterations > 1, and compared with
the same op written in Python (forward and gradients).

The library is built in a subprocess (which loads it there); this process then loads
the file with the documented step only. Skipped, visibly, when there is no C++
compiler."""
import ctypes
import pathlib
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import poptorch

SOURCE = pathlib.Path(__file__).parent / "custom_ops" / "scaled_cube.cpp"
ATTRS = {"alpha": 0.5, "power": 3, "mode": "subtract", "scales": [1.0, 2.0, 0.5],
         "offsets": [2, -1], "tags": ["a", "b"]}

pytestmark = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                                reason="no C++ compiler to build the custom op library")

_BUILD = ("import sys, torch.utils.cpp_extension as ce; "
          "print(ce.load(name='poptorch_test_scaled_cube', sources=[sys.argv[1]], "
          "build_directory=sys.argv[2], is_python_module=False, extra_cflags=['-O1']))")


@pytest.fixture(scope="module")
def library(tmp_path_factory):
    build = tmp_path_factory.mktemp("scaled_cube")
    done = subprocess.run([sys.executable, "-c", _BUILD, str(SOURCE), str(build)],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    path = pathlib.Path(done.stdout.strip().splitlines()[-1])
    assert path.is_file()
    # loading_library (the step upstream's user guide documents)
    ctypes.cdll.LoadLibrary(str(path))
    _register_autograd()
    return path


def _register_autograd():
    """The autograd formula: ScaledCube's gradients come from ScaledCubeBackward."""
    def setup_context(ctx, inputs, keyword_only_inputs, output):
        ctx.save_for_backward(inputs[0])
        ctx.attrs = keyword_only_inputs

    def backward(ctx, grad_out, grad_echo):
        (x,) = ctx.saved_tensors
        attrs = {k: v for k, v in ctx.attrs.items() if k != "offsets"}
        grad_x, grad_bias = torch.ops.com_acme.ScaledCubeBackward(
            grad_out.contiguous(), grad_echo.contiguous(), x, **attrs)
        return grad_x, grad_bias

    torch.library.register_autograd("com_acme::ScaledCube", backward,
                                    setup_context=setup_context)


def python_scaled_cube(x, bias, alpha, power, mode, scales, offsets, tags):
    sign = {"add": 1.0, "subtract": -1.0}[mode]
    return (alpha * sum(scales) * x ** power + sign * bias + sum(offsets),
            x * len(tags))


class Net(torch.nn.Module):
    def __init__(self, use_cpp):
        super().__init__()
        self.fc = torch.nn.Linear(6, 6)
        self.use_cpp = use_cpp

    def forward(self, x, bias, target):
        h = torch.tanh(self.fc(x))
        if self.use_cpp:
            out, echo = poptorch.custom_op([h, bias], "ScaledCube", "com.acme", 1,
                                           example_outputs=[h, h], attributes=ATTRS)
        else:
            out, echo = python_scaled_cube(h, bias, **ATTRS)
        loss = F.mse_loss(out, target) + echo.pow(2).mean() * 0.01
        return out, loss


def test_inference_matches_python(library):
    x, bias = torch.randn(4, 6), torch.randn(4, 6)
    cpp, py = Net(True), Net(False)
    py.load_state_dict(cpp.state_dict())
    out, loss = poptorch.inferenceModel(cpp)(x, bias, torch.zeros(4, 6))
    ref_out, ref_loss = py(x, bias, torch.zeros(4, 6))
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(loss, ref_loss)


def test_gradients_match_python(library):
    x = torch.randn(3, 6, requires_grad=True)
    bias = torch.randn(3, 6, requires_grad=True)
    gx = [None, None]
    for i, fn in enumerate((lambda *a: torch.ops.com_acme.ScaledCube(*a, **ATTRS),
                            lambda *a: python_scaled_cube(*a, **ATTRS))):
        x.grad = bias.grad = None
        out, echo = fn(x, bias)
        (out.sum() * 2 + echo.pow(2).sum()).backward()
        gx[i] = (x.grad.clone(), bias.grad.clone())
    torch.testing.assert_close(gx[0][0], gx[1][0])
    torch.testing.assert_close(gx[0][1], gx[1][1])


def test_training_with_device_iterations_matches_python(library):
    torch.manual_seed(0)
    cpp, py = Net(True), Net(False)
    py.load_state_dict(cpp.state_dict())
    opts = poptorch.Options().deviceIterations(3)
    pm = poptorch.trainingModel(cpp, opts, torch.optim.SGD(cpp.parameters(), lr=0.05))
    ref_opt = torch.optim.SGD(py.parameters(), lr=0.05)
    x, bias, target = torch.randn(6, 6), torch.randn(6, 6), torch.randn(6, 6)
    for _ in range(2):
        pm(x, bias, target)
        for xs, bs, ts in zip(x.chunk(3), bias.chunk(3), target.chunk(3), strict=False):
            ref_opt.zero_grad()
            py(xs, bs, ts)[1].backward()
            ref_opt.step()
    for p, q in zip(cpp.parameters(), py.parameters(), strict=False):
        torch.testing.assert_close(p, q)


def test_compiled_backend_uses_shapes_from_example_outputs(library):
    # The C++ op has no meta kernel: custom_op registers one from example_outputs, so a
    # compiled graph can hold the op (traced with fake tensors of those shapes).
    def fn(h, b):
        return poptorch.custom_op([h, b], "ScaledCube", "com.acme", 1,
                                  example_outputs=[h, h], attributes=ATTRS)
    h, b = torch.randn(2, 6), torch.randn(2, 6)
    fn(h, b)
    assert torch._library.simple_registry.singleton.find(
        "com_acme::ScaledCube").fake_impl.kernel is not None
    out = torch.compile(fn, backend="eager", fullgraph=True)(h, b)
    torch.testing.assert_close(out[0], python_scaled_cube(h, b, **ATTRS)[0])
    torch.testing.assert_close(out[1], python_scaled_cube(h, b, **ATTRS)[1])


def test_missing_name_domain_and_bad_attributes_raise(library):
    h = torch.randn(2, 6)
    with pytest.raises(poptorch.Error, match="has no operator 'Cube'.*ScaledCube"):
        poptorch.custom_op([h, h], "Cube", "com.acme", 1, example_outputs=[h, h])
    # A domain nobody registered: what a user sees when the library was never loaded.
    with pytest.raises(poptorch.Error, match="nothing is registered.*LoadLibrary"):
        poptorch.custom_op([h], "ScaledCube", "org.nobody", 1, example_outputs=[h])
    with pytest.raises(RuntimeError, match="mode must be 'add' or 'subtract'"):
        poptorch.custom_op([h, h], "ScaledCube", "com.acme", 1, example_outputs=[h, h],
                           attributes=dict(ATTRS, mode="multiply"))
    with pytest.raises(poptorch.Error, match="example_outputs\\[0\\] has shape"):
        poptorch.custom_op([h, h], "ScaledCube", "com.acme", 1,
                           example_outputs=[torch.zeros(3), h], attributes=ATTRS)


def test_missing_library_file_raises_oserror(tmp_path):
    with pytest.raises(OSError):
        ctypes.cdll.LoadLibrary(str(tmp_path / "libmissing_op.so"))
