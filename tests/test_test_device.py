"""``POPTORCH_TEST_DEVICE`` (tests/conftest.py): ``cuda`` on a machine without a CUDA GPU
skips every test, visibly and with the reason, instead of failing or silently running
on the CPU."""
import os
import subprocess
import sys

import pytest
import torch


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU")
def test_cuda_test_device_without_a_gpu_skips_with_the_reason(tmp_path):
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, POPTORCH_TEST_DEVICE="cuda")
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:randomly", "-p",
         "no:cacheprovider", os.path.join(here, "test_cuda_graphs.py"), "-k",
         "graph_key or environment"],
        env=env, check=False, capture_output=True, text=True, timeout=300, cwd=str(tmp_path))
    out = run.stdout + run.stderr
    assert run.returncode == 0, out
    assert "2 skipped" in out and "passed" not in out, out
    assert "POPTORCH_TEST_DEVICE=cuda, but torch finds no CUDA GPU" in out, out


def test_unknown_test_device_is_a_usage_error(tmp_path):
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, POPTORCH_TEST_DEVICE="tpu")
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         os.path.join(here, "test_test_device.py"), "-k", "nothing_matches"],
        env=env, check=False, capture_output=True, text=True, timeout=300, cwd=str(tmp_path))
    assert run.returncode != 0
    assert "POPTORCH_TEST_DEVICE='tpu'" in run.stdout + run.stderr
