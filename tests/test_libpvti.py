"""libpvti (issue 24): tracepoints, events, graph series and heatmaps land in the run's
Perfetto trace, beside PopTorch's own ranges, with the right names, nesting and values;
nothing is recorded when tracing is off."""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

import libpvti as pvti
import poptorch

HERE = pathlib.Path(__file__).resolve().parent


def run_program(tmp_path, pvti_options):
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    env.pop("POPLAR_ENGINE_OPTIONS", None)
    env.pop("PVTI_OPTIONS", None)
    if pvti_options is not None:
        env["PVTI_OPTIONS"] = json.dumps(pvti_options)
    result = subprocess.run([sys.executable, str(HERE / "libpvti_program.py"),
                             str(tmp_path / "facts.json")], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    return json.loads((tmp_path / "facts.json").read_text())


def within(inner, outer):
    return outer["ts"] <= inner["ts"] and \
        inner["ts"] + inner["dur"] <= outer["ts"] + outer["dur"] + 1e-3


def test_tracepoints_events_series_and_heatmaps_in_the_trace(tmp_path):
    facts = run_program(tmp_path, {"enable": "true", "directory": "reports"})
    assert facts["enabled"]
    files = list((tmp_path / "reports").glob("poptorch.*.trace.json"))
    assert len(files) == 1
    events = json.loads(files[0].read_text())["traceEvents"]
    ranges = [e for e in events if e.get("ph") == "X"]

    def named(name):
        return [e for e in ranges if e.get("name") == name]

    epochs = [named(f"App::Epoch:{i}") for i in (0, 1)]
    assert [len(e) for e in epochs] == [1, 1]
    decorated, inner = named("App::decorated"), named("App::inner")
    assert len(decorated) == len(inner) == 2
    calls = [e for e in ranges if e["name"].startswith("poptorch::") and " call " in e["name"]]
    assert len(calls) == 2  # PopTorch's own ranges, in the same file
    for i in (0, 1):
        assert within(decorated[i], epochs[i][0]) and within(inner[i], decorated[i])
        assert within(calls[i], inner[i])
        assert decorated[i]["tid"] == inner[i]["tid"] == epochs[i][0]["tid"]
    instants = [e for e in events if e.get("ph") == "i" and e.get("cat") == "pvti"]
    assert [e["name"] for e in instants] == ["Instant Events::Epoch 0 begin",
                                             "Instant Events::Epoch 1 begin"]
    # each just before its epoch's range, on torch's clock (within the clock alignment)
    for instant, epoch in zip(instants, epochs, strict=False):
        assert abs(epoch[0]["ts"] - instant["ts"]) < 200, (instant["ts"], epoch[0]["ts"])
    assert epochs[0][0]["ts"] + epochs[0][0]["dur"] < instants[1]["ts"] + 200
    counters = [e for e in events if e.get("ph") == "C" and e.get("cat") == "pvti"]
    loss = [e["args"]["Training Loss"] for e in counters if e["name"] == "Loss"]
    assert loss == facts["losses"]
    assert [e["args"] for e in counters if e["name"] == "Accuracy [%]"] == \
        [{"Validation Accuracy": 50.0}]
    # heatmap: counts per bucket (-inf,-1) [-1,0) [0,1) [1,inf), against torch.bucketize
    maps = [e["args"] for e in counters if e["name"] == "weights [x]"]
    assert len(maps) == 2
    for args, w in zip(maps, facts["weights"], strict=False):
        index = torch.bucketize(torch.tensor(w), torch.tensor([-1.0, 0.0, 1.0]), right=True)
        expected = torch.bincount(index, minlength=4).tolist()
        assert list(args.values()) == expected
        assert list(args) == ["[-inf, -1.0)", "[-1.0, 0.0)", "[0.0, 1.0)", "[1.0, inf)"]
    # the events sit on torch's clock: the epochs' ranges follow each other
    assert epochs[0][0]["ts"] + epochs[0][0]["dur"] <= epochs[1][0]["ts"]


def test_nothing_is_recorded_when_tracing_is_off(tmp_path):
    (tmp_path / "off").mkdir()
    (tmp_path / "on").mkdir()
    facts = run_program(tmp_path / "off", None)
    assert not facts["enabled"]
    assert not list((tmp_path / "off").rglob("*.trace.json"))
    # the program's results do not depend on tracing
    assert facts["losses"] == run_program(tmp_path / "on", {"enable": "true"})["losses"]
    assert list((tmp_path / "on").glob("poptorch.*.trace.json"))


def test_bad_arguments_are_errors():
    channel = pvti.createTraceChannel("c")
    with pytest.raises(poptorch.Error, match="non-empty string"):
        pvti.createTraceChannel("")
    with pytest.raises(poptorch.Error, match="expected a channel"):
        pvti.Tracepoint("c", "x")
    with pytest.raises(poptorch.Error, match="strictly increasing"):
        pvti.HeatmapDouble("h", [1.0, 0.0])
    with pytest.raises(poptorch.Error, match="expected a number"):
        pvti.Graph("g").addSeries("s").add("high")
    with pytest.raises(poptorch.Error, match="expected a channel"):
        pvti.Tracepoint.event("c", "x")
    pvti.Tracepoint.begin(channel, "a")
    with pytest.raises(poptorch.Error, match="innermost open tracepoint is c::a"):
        pvti.Tracepoint.end(channel, "b")
    pvti.Tracepoint.end(channel, "a")
