"""Option setters take what upstream PopTorch 3.4 takes, with upstream's meaning, and
refuse what it refuses with the same error class.

Upstream's facts used here: ``enableSyntheticData(x)`` sets PopART's
``syntheticDataMode`` to 2 (random normal) when ``x`` is true and 0 otherwise;
``showCompilationProgressBar`` / ``relaxOptimizerAttributesChecks`` store the value and
read it as a truth value; ``Jit.traceModel`` raises only for a true value (we record
it); ``maxRepeatLogs`` takes any int >= 0; ``setAvailableMemoryProportion`` takes any
real number PopART's parser converts (numpy scalars too); ``updatableNamedBuffers``
takes a list, tuple or set; ``setConvolutionDithering`` passes ``1`` / ``0`` to Poplar
as ``True`` / ``False`` do; ``inputReplicaGrouping(n, NoGrouping)`` is a group of one
replica, arranged consecutively; ``anchorTensor`` ignores the period unless the mode is
``EveryN``. Its setters raise ``AssertionError`` for a wrong type, ``ValueError`` for a
refused reduction type, partials type, replica group or running-statistics flag, and
``AttributeError`` for frozen options.
"""
import logging

import numpy as np
import pytest
import torch

import poptorch
from poptorch import _logging


def _call(opts, path, *args):
    target = opts
    for part in path.split(".")[:-1]:
        target = getattr(target, part)
    return getattr(target, path.split(".")[-1])(*args)


# ----------------------------------------------------------- read as truth values
@pytest.mark.parametrize("value,mode", [
    (True, 2), (2, 2), (1, 2), (np.bool_(True), 2), (np.int64(2), 2), ("yes", 2),
    (False, 0), (0, 0), (None, 0), (np.bool_(False), 0), ("", 0)])
def test_enable_synthetic_data_reads_a_truth_value(value, mode):
    # DINO: opts.enableSyntheticData(int(popart.SyntheticDataMode.RandomNormal))
    opts = poptorch.Options().enableSyntheticData(value)
    assert opts.synthetic_data is bool(mode)
    assert opts._synthetic_data_mode() == mode
    assert opts._Popart.options["syntheticDataMode"] == mode  # as upstream's toDict


def test_synthetic_data_mode_set_through_popart_wins_when_later():
    opts = poptorch.Options().enableSyntheticData(True)
    opts._Popart.set("syntheticDataMode", 1)  # zeros
    assert opts._synthetic_data_mode() == 1
    assert poptorch.Options()._synthetic_data_mode() == 0
    with pytest.raises(AssertionError, match="syntheticDataMode"):
        opts._Popart.set("syntheticDataMode", 3)
    with pytest.raises(poptorch.Error, match="syntheticDataMode"):
        opts._Popart.set("syntheticDataMode", True)  # upstream: no bool option of that name
    assert opts._synthetic_data_mode() == 1


@pytest.mark.parametrize("setter,key", [
    ("showCompilationProgressBar", "show_compilation_progress_bar"),
    ("relaxOptimizerAttributesChecks", "relax_optimizer_attributes_checks"),
    ("Jit.traceModel", "Jit.trace_model")])
@pytest.mark.parametrize("value", [0, 1, None, np.bool_(True), "", 0.0, [1]])
def test_truth_value_setters(setter, key, value):
    opts = poptorch.Options()
    _call(opts, setter, value)
    owner = opts.Jit if key.startswith("Jit.") else opts
    assert getattr(owner, key.split(".")[-1]) is bool(value)


@pytest.mark.parametrize("show", [0, 1])
def test_progress_bar_follows_the_truth_value(show, capfd):
    model = torch.nn.Linear(3, 2)
    opts = poptorch.Options().showCompilationProgressBar(show)
    poptorch.inferenceModel(model, opts)(torch.ones(2, 3))
    err = capfd.readouterr().err
    assert ("Graph compilation" in err) is bool(show)


# ----------------------------------------------------------- values upstream takes
@pytest.fixture
def restore_repeat_limit():
    yield
    _logging.set_max_repeat_logs(4)


def test_max_repeat_logs_zero_suppresses_every_repeat(caplog, restore_repeat_limit):
    caplog.set_level(logging.INFO, logger="poptorch::python")
    level = poptorch.logger.level
    poptorch.setLogLevel("INFO")
    try:
        opts = poptorch.Options().maxRepeatLogs(0)
        assert opts.max_repeat_logs == 0
        opts._apply_effects()  # what compiling a model with these options does
        for _ in range(4):
            poptorch.logger.info("again and again")
        poptorch.logger.info("other")
    finally:
        poptorch.logger.setLevel(level)
    messages = [r.getMessage() for r in caplog.records if r.name == "poptorch::python"]
    assert messages.count("again and again") == 1
    assert any("repeated 3 more times" in m for m in messages)


@pytest.mark.parametrize("value", [np.float32(0.25), np.float64(0.25), np.float16(0.25)])
def test_memory_proportion_takes_numpy_scalars(value):
    opts = poptorch.Options().setAvailableMemoryProportion({"IPU0": value, "IPU1": 1})
    stored = opts.available_memory_proportion
    assert stored == {"IPU0": 0.25, "IPU1": 1} and type(stored["IPU0"]) is float


def test_updatable_named_buffers_takes_a_set():
    opts = poptorch.Options().updatableNamedBuffers({"bn.running_var", "bn.running_mean"})
    assert opts.updatable_named_buffers == ["bn.running_mean", "bn.running_var"]
    opts = poptorch.Options().updatableNamedBuffers(("a",))
    assert opts.updatable_named_buffers == ["a"]


@pytest.mark.parametrize("value,expected", [(1, True), (0, False), (True, True)])
def test_convolution_dithering_takes_one_and_zero(value, expected):
    opts = poptorch.Options()
    opts.Training.setConvolutionDithering(value)
    assert opts.Training.convolution_dithering is expected
    with pytest.raises(AssertionError, match="setConvolutionDithering"):
        opts.Training.setConvolutionDithering(2)


def test_no_grouping_means_groups_of_one_replica():
    opts = poptorch.Options().replicationFactor(4)
    opts.inputReplicaGrouping(4, poptorch.CommGroupType.NoGrouping)
    default = poptorch.Options().replicationFactor(4)
    assert (opts.input_group_size, opts.input_cgt) == (1, poptorch.CommGroupType.Consecutive)
    assert (opts.input_group_size, opts.input_cgt) == (default.input_group_size,
                                                       default.input_cgt)


def test_anchor_period_only_counts_with_every_n():
    opts = poptorch.Options()
    opts.anchorTensor("a", "x", poptorch.OutputMode.All, 0)
    opts.anchorTensor("b", "y", None, 5)
    opts.anchorTensor("c", "z", poptorch.OutputMode.EveryN, 3)
    periods = {k: v["output_return_period"] for k, v in opts.anchored_tensors.items()}
    assert periods == {"a": 1, "b": 1, "c": 3}
    with pytest.raises(AssertionError, match="output_return_period"):
        opts.anchorTensor("d", "w", poptorch.OutputMode.EveryN, 0)


@pytest.mark.parametrize("value", [torch.ones(1), None, np.int64(1), object()])
def test_popart_set_refuses_values_popart_cannot_take(value):
    opts = poptorch.Options()
    with pytest.raises(poptorch.Error, match="PopART options take"):
        opts._Popart.set("someOption", value)
    assert "someOption" not in opts._Popart.options
    for ok in (1, 1.5, "s", True, [1, "a"], ("a",), {"a"}, {"k": "v"}):
        opts._Popart.set("someOption", ok)


# ----------------------------------------------------------- refusals: upstream's classes
ASSERTION = [  # upstream: AssertionError from its isinstance / range asserts
    ("deviceIterations", (2.0,)), ("deviceIterations", (np.int64(2),)),
    ("replicationFactor", ("2",)), ("broadcastBuffers", (1,)),
    ("autoRoundNumIPUs", (np.bool_(True),)), ("useIpuId", (1.0,)),
    ("randomSeed", (1.5,)), ("outputMode", (7,)),
    ("outputMode", (poptorch.OutputMode.EveryN,)), ("connectionType", (None,)),
    ("syncPattern", (9,)), ("setAvailableMemoryProportion", ({"GPU0": 0.5},)),
    ("setExecutionStrategy", ("pipelined",)), ("logDir", (None,)),
    ("Training.gradientAccumulation", (2.0,)),
    ("Training.setMeanAccumulationAndReplicationReductionStrategy", (None,)),
    ("Precision.enableFloatingPointExceptions", (1,)),
    ("TensorLocations.numIOTiles", (np.int64(32),)),
    ("TensorLocations.setWeightLocation", ({"onChip": False},)),
    ("Distributed.configureProcessId", (np.int64(0), 2)),
    ("_Popart.setPatterns", ({"P": True}, 2.0)),
]
VALUE = [  # upstream: ValueError
    ("inputReplicaGrouping", (1, poptorch.CommGroupType.All)),
    ("setAvailableMemoryProportion", ({"IPUx": 0.5},)),
    ("Training.accumulationAndReplicationReductionType", (poptorch.ReductionType.NoReduction,)),
    ("Training.accumulationAndReplicationReductionType", (poptorch.OutputMode.Final,)),
    ("Precision.runningStatisticsAlwaysFloat", (1,)),
    ("Precision.setPartialsType", (torch.bfloat16,)),
    ("Precision.setPartialsType", ("half",)),
]


@pytest.mark.parametrize("setter,args", ASSERTION, ids=[f"{s}-{i}" for i, (s, _) in
                                                        enumerate(ASSERTION)])
def test_refused_types_are_assertion_errors(setter, args):
    opts = poptorch.Options()
    before = opts.toDict()
    with pytest.raises(AssertionError) as info:
        _call(opts, setter, *args)
    assert isinstance(info.value, poptorch.Error)
    assert setter.split(".")[-1] in str(info.value)
    assert opts.toDict() == before


@pytest.mark.parametrize("setter,args", VALUE, ids=[f"{s}-{i}" for i, (s, _) in
                                                    enumerate(VALUE)])
def test_refused_choices_are_value_errors(setter, args):
    opts = poptorch.Options()
    before = opts.toDict()
    with pytest.raises(ValueError) as info:
        _call(opts, setter, *args)
    assert isinstance(info.value, poptorch.Error)
    assert setter.split(".")[-1] in str(info.value)
    assert opts.toDict() == before


def test_env_var_names_refusals(monkeypatch):
    opts = poptorch.Options()
    with pytest.raises(TypeError, match="setEnvVarNames"):
        opts.Distributed.setEnvVarNames(1, "RANK_VAR")
    monkeypatch.setenv("SIZE_VAR", "two")
    with pytest.raises(ValueError, match="SIZE_VAR"):
        opts.Distributed.setEnvVarNames("SIZE_VAR", "RANK_VAR")


def test_frozen_options_refuse_with_an_attribute_error():
    opts = poptorch.Options()
    poptorch.inferenceModel(torch.nn.Linear(2, 2), opts)
    for change in (lambda: opts.deviceIterations(2),
                   lambda: opts.Training.gradientAccumulation(2),
                   lambda: opts._Popart.set("x", 1)):
        with pytest.raises(AttributeError, match="frozen") as info:
            change()
        assert isinstance(info.value, poptorch.Error)
