"""Shared test configuration: the device the IPUs run on, the backend, quiet logs,
deterministic torch settings.

**Device** (``POPTORCH_TEST_DEVICE=cpu|cuda``, default ``cpu``): with ``cpu`` the IPUs
are virtual CPU devices (``POPTORCH_IPU_MODEL=1``, also on a machine with GPUs); with
``cuda`` they are the GPUs, IPU *k* on ``cuda:k`` (``poptorch/_devices.py``). Where a
test compares a GPU result with a reference computed on the CPU, cuBLAS / cuDNN
reductions round differently: ``torch.testing.assert_close`` then allows at least
:data:`GPU_TOLERANCE` (the ``tolerance`` fixture gives the same numbers to tests that
compare by hand), and TF32 is turned off so that float32 stays float32. Without a CUDA
GPU, ``POPTORCH_TEST_DEVICE=cuda`` skips every test with that reason instead of
running them on the CPU unnoticed.

**Backend**: the suite runs the eager backend unless ``POPTORCH_BACKEND`` is set: the
automatic choice compiles and measures every model at its first calls, which would make
the suite take hours on the CPU. ``.ci/run`` runs the equivalence tests once more with
``POPTORCH_BACKEND=auto`` (the default a user gets); tests/test_backend_choice.py tests
the automatic choice itself. Its stored decisions are turned off
(``POPTORCH_BACKEND_DECISIONS=off``) unless a test sets a folder.
"""
from __future__ import annotations

import functools
import os

import pytest
import torch

os.environ.setdefault("POPTORCH_LOG_LEVEL", "WARN")
os.environ.setdefault("POPTORCH_BACKEND", "eager")
# The automatic backend's decisions (_runtime/executable/decisions.py) are not kept
# between tests: each test measures for itself (tests of the store set a folder).
os.environ.setdefault("POPTORCH_BACKEND_DECISIONS", "off")

TEST_DEVICE = os.environ.get("POPTORCH_TEST_DEVICE", "cpu").strip().lower() or "cpu"
if TEST_DEVICE not in ("cpu", "cuda"):
    raise pytest.UsageError(f"POPTORCH_TEST_DEVICE={TEST_DEVICE!r}: use 'cpu' or 'cuda'.")

CPU_TOLERANCE = {"rtol": 1.3e-6, "atol": 1e-5}
"""torch.testing.assert_close's float32 defaults: what a CPU run is held to."""
GPU_TOLERANCE = {"rtol": 1e-4, "atol": 1e-4}
"""The least a GPU result is allowed against a CPU reference (float32, no TF32): cuBLAS
and cuDNN sum in other orders than the CPU kernels."""

NO_GPU_REASON = ("POPTORCH_TEST_DEVICE=cuda, but torch finds no CUDA GPU "
                 f"(torch {torch.__version__}, torch.cuda.is_available() is False): "
                 "run on a GPU machine (benchmarks/gpu_check.sh) or unset it")

if TEST_DEVICE == "cpu":
    if torch.cuda.is_available():
        os.environ["POPTORCH_IPU_MODEL"] = "1"  # virtual CPU IPUs, even next to GPUs
else:
    os.environ.pop("POPTORCH_IPU_MODEL", None)
    if torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False


def gpu_run() -> bool:
    """Whether the IPUs of this test run are CUDA GPUs."""
    return TEST_DEVICE == "cuda" and torch.cuda.is_available()


def pytest_report_header(config):
    if TEST_DEVICE == "cuda" and not torch.cuda.is_available():
        return f"poptorch test device: cuda -- every test skipped: {NO_GPU_REASON}"
    if TEST_DEVICE == "cuda":
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        return f"poptorch test device: cuda ({', '.join(names)}), IPU k = cuda:k"
    return "poptorch test device: cpu (IPU Model: virtual CPU IPUs)"


def pytest_collection_modifyitems(config, items):
    if TEST_DEVICE == "cuda" and not torch.cuda.is_available():
        skip = pytest.mark.skip(reason=NO_GPU_REASON)
        for item in items:
            item.add_marker(skip)


@pytest.fixture
def tolerance() -> dict:
    """``rtol`` / ``atol`` for comparing this run's device results with a CPU reference
    (``torch.testing.assert_close(actual, expected, **tolerance)``)."""
    return dict(GPU_TOLERANCE if gpu_run() else CPU_TOLERANCE)


def _widened(assert_close):
    @functools.wraps(assert_close)
    def check(actual, expected, *args, **kwargs):
        if _floating(actual):
            kwargs["rtol"] = max(kwargs.get("rtol") or 0.0, GPU_TOLERANCE["rtol"])
            kwargs["atol"] = max(kwargs.get("atol") or 0.0, GPU_TOLERANCE["atol"])
        return assert_close(actual, expected, *args, **kwargs)
    return check


def _floating(value) -> bool:
    from torch.utils import _pytree as pytree
    return any(isinstance(t, torch.Tensor) and t.is_floating_point()
               for t in pytree.tree_leaves(value))


@pytest.fixture(autouse=True)
def _gpu_tolerances(monkeypatch):
    """On a GPU run, float comparisons allow at least :data:`GPU_TOLERANCE`."""
    if gpu_run():
        monkeypatch.setattr(torch.testing, "assert_close",
                            _widened(torch.testing.assert_close))
    yield


@pytest.fixture(autouse=True)
def _deterministic_torch():
    """Each test starts from the same global RNG state and default dtype."""
    torch.manual_seed(0)
    yield
    torch.set_default_dtype(torch.float32)


@pytest.fixture
def ctrl_c_raises_keyboard_interrupt():
    """SIGINT raises KeyboardInterrupt in this process while the test runs, and children
    it starts get the default SIGINT action (Python's handler is reset to the default at
    exec), whatever the suite was started with: a shell's background job or ``nohup``
    starts it with SIGINT ignored, which ``_thread.interrupt_main`` then does nothing
    with and which every child inherits (a Ctrl-C test would wait for an interrupt that
    never comes)."""
    import signal
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
