"""Shared test configuration: quiet logs, deterministic torch settings, the backend.

The suite runs the eager backend unless ``POPTORCH_BACKEND`` is set: the automatic
choice compiles and measures every model at its first calls, which would make the suite
take hours on the CPU. ``.ci/run`` runs the equivalence tests once more with
``POPTORCH_BACKEND=auto`` (the default a user gets); tests/test_backend_choice.py tests
the automatic choice itself.
"""
import os

import pytest
import torch

os.environ.setdefault("POPTORCH_LOG_LEVEL", "WARN")
os.environ.setdefault("POPTORCH_BACKEND", "eager")


@pytest.fixture(autouse=True)
def _deterministic_torch():
    """Each test starts from the same global RNG state and default dtype."""
    torch.manual_seed(0)
    yield
    torch.set_default_dtype(torch.float32)
