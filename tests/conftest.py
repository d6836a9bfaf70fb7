"""Shared test configuration: quiet logs and deterministic torch settings."""
import os

import pytest
import torch

os.environ.setdefault("POPTORCH_LOG_LEVEL", "WARN")


@pytest.fixture(autouse=True)
def _deterministic_torch():
    """Each test starts from the same global RNG state and default dtype."""
    torch.manual_seed(0)
    yield
    torch.set_default_dtype(torch.float32)
