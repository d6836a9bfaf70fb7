"""Hint ops, options and environment variables that only mean something on an IPU:
each logs once at INFO what it would do on an IPU and that it has no effect here, and
results equal plain PyTorch."""
import logging

import pytest
import torch

import poptorch
from poptorch import _logging


@pytest.fixture
def info_logs(caplog, monkeypatch):
    monkeypatch.setattr(_logging, "_once_keys", set())
    caplog.set_level(logging.INFO, logger="poptorch::python")

    def messages(word):
        return [r.getMessage() for r in caplog.records if word in r.getMessage()]
    return messages


class Hinted(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 2, 3)

    def forward(self, x):
        x = poptorch.set_overlap_for_input(x, poptorch.OverlapMode.OverlapAccumulationLoop)
        with poptorch.MultiConv() as mc:
            mc.availableMemoryProportions(0.3).planType(poptorch.MultiConvPlanType.Serial)
            y = self.conv(x)
        y = poptorch.set_available_memory(y, 0.4)
        return poptorch.set_overlap_for_output(y, poptorch.OverlapMode.NoOverlap)


def test_hint_ops_log_once_and_change_nothing(info_logs):
    model = Hinted()
    x = torch.randn(2, 1, 5, 5)
    # as on an IPU, overlapped IO needs IO tiles and a strategy other than pipelining
    opts = poptorch.Options().setExecutionStrategy(poptorch.ShardedExecution())
    opts.TensorLocations.numIOTiles(32)
    pm = poptorch.inferenceModel(model, opts)
    pm(x)
    out = pm(x)
    assert torch.equal(out, model.conv(x))
    for word in ("set_overlap_for_input", "set_overlap_for_output",
                 "set_available_memory", "MultiConv"):
        logs = info_logs("poptorch." + word)
        assert len(logs) == 1, word
        assert "on an IPU" in logs[0] and "no effect" in logs[0]


def test_ipu_only_options_log_what_they_would_do(info_logs):
    opts = poptorch.Options().useOfflineIpuTarget(2)
    opts.TensorLocations.numIOTiles(32)
    opts.Precision.setPartialsType(torch.half)
    layer = torch.nn.Linear(3, 3)
    x = torch.randn(2, 3)
    # an offline target compiles but does not run, as upstream
    poptorch.inferenceModel(layer, opts).compile(x)
    offline = info_logs("ipu_version")
    assert len(offline) == 1 and "offline IPU" in offline[0] and "no effect" in offline[0]
    tiles = info_logs("num_io_tiles")
    assert len(tiles) == 1 and "overlap" in tiles[0]
    partials = info_logs("setPartialsType")
    assert len(partials) == 1 and "on an IPU" in partials[0] and "no effect" in partials[0]


# Requests for profiling (autoReport.all, PVTI enable) start the whole-run profiler; they
# are tested in a fresh interpreter by tests/test_profiling_run.py, as is the
# poptorch.Error for a value that is not JSON.
@pytest.mark.parametrize("variable, value, logged", [
    ("POPLAR_ENGINE_OPTIONS", '{"opt.enableMultiAccessCopies": "false"}', True),
    ("PVTI_OPTIONS", '{"enable": "false"}', True),
])
def test_ipu_environment_variables(info_logs, monkeypatch, tmp_path, variable, value,
                                   logged):
    monkeypatch.chdir(tmp_path)  # profiling requests may write report files here
    monkeypatch.setenv(variable, value)
    layer = torch.nn.Linear(2, 2)
    x = torch.randn(1, 2)
    assert torch.equal(poptorch.inferenceModel(layer)(x), layer(x))
    logs = info_logs(variable + "=")
    assert len(logs) == (1 if logged else 0)
    if logged:
        assert "on an IPU" in logs[0] and "no effect" in logs[0]
