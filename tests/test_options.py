"""poptorch.Options: setters, validation, toDict, clone, freezing, config files, JSON."""
import copy
import logging

import pytest
import torch

import poptorch
from poptorch import enums
from poptorch.options import _PopartOptions

TLS = poptorch.TensorLocationSettings


def _call(opts, path, args):
    target = opts
    for part in path.split(".")[:-1]:
        target = getattr(target, part)
    return getattr(target, path.split(".")[-1])(*args)


def _lookup(d, key_path):
    for key in key_path.split("."):
        d = d[key]
    return d


# (setter, args, key in toDict(), expected stored value)
VALID = [
    ("deviceIterations", (5,), "device_iterations", 5),
    ("replicationFactor", (4,), "replication_factor", 4),
    ("inputReplicaGrouping", (2, poptorch.CommGroupType.Orthogonal), "input_group_size", 2),
    ("inputReplicaGrouping", (2, poptorch.CommGroupType.Orthogonal), "input_cgt",
     poptorch.CommGroupType.Orthogonal),
    ("broadcastBuffers", (False,), "broadcast_buffers", False),
    ("outputMode", (poptorch.OutputMode.All,), "output_mode", poptorch.OutputMode.All.value),
    ("outputMode", (poptorch.OutputMode.EveryN, 3), "output_return_period", 3),
    ("outputMode", ("Sum",), "output_mode", poptorch.OutputMode.Sum.value),
    ("anchorMode", (poptorch.AnchorMode.Final,), "output_mode", poptorch.OutputMode.Final.value),
    ("anchorTensor", ("g", "Gradient___w", poptorch.OutputMode.All, 1), "anchored_tensors",
     {"g": {"long_name": "Gradient___w", "output_mode": 2, "output_return_period": 1}}),
    ("anchorTensor", ("w", "w"), "anchored_tensors",
     {"w": {"long_name": "w", "output_mode": None, "output_return_period": 1}}),
    ("autoRoundNumIPUs", (True,), "auto_round_num_ipus", True),
    ("useIpuModel", (True,), "use_model", True),
    ("useIpuId", (3,), "ipu_id", 3),
    ("useOfflineIpuTarget", (21,), "ipu_version", 21),
    ("connectionType", (poptorch.ConnectionType.OnDemand,), "connection_type", 1),
    ("syncPattern", (poptorch.SyncPattern.SinglePipeline,), "sync_pattern", 1),
    ("setAvailableMemoryProportion", ({"IPU0": 0.3, "IPU1": 1},),
     "available_memory_proportion", {"IPU0": 0.3, "IPU1": 1}),
    ("randomSeed", (42,), "random_seed", 42),
    ("enableSyntheticData", (True,), "synthetic_data", True),
    ("enableStableNorm", (True,), "enable_stable_norm", True),
    ("updatableNamedBuffers", (["bn.running_mean"],), "updatable_named_buffers",
     ["bn.running_mean"]),
    ("relaxOptimizerAttributesChecks", (), "relax_optimizer_attributes_checks", True),
    ("showCompilationProgressBar", (False,), "show_compilation_progress_bar", False),
    ("enableExecutableCaching", ("/tmp/cache",), "executable_cache_dir", "/tmp/cache"),
    ("enableProfiling", (), "profile_dir", "."),
    ("enableProfiling", ("prof",), "profile_dir", "prof"),
    ("modelName", ("bert",), "model_name", "bert"),
    ("logDir", ("logs",), "log_dir", "logs"),
    ("maxRepeatLogs", (2,), "max_repeat_logs", 2),
    ("maxRepeatLogs", (None,), "max_repeat_logs", None),
    ("logCycleCount", (True,), "log_cycle_count", True),
    ("disableModuleNamescope", (), "module_namescope", False),
    ("sourceLocationExcludes", (["a"],), "source_location_excludes", ["a"]),
    ("appendToLocationExcludes", ("x", "y"), "source_location_excludes",
     ["install/poptorch", "site-packages/torch", "site-packages/poptorch", "x", "y"]),
    ("Training.gradientAccumulation", (8,), "Training.gradient_accumulation", 8),
    ("Training.accumulationAndReplicationReductionType", (poptorch.ReductionType.Sum,),
     "Training.accumulation_and_replication_reduction_type", poptorch.ReductionType.Sum),
    ("Training.accumulationReductionType", (poptorch.ReductionType.Sum,),
     "Training.accumulation_and_replication_reduction_type", poptorch.ReductionType.Sum),
    ("Training.setMeanAccumulationAndReplicationReductionStrategy",
     (poptorch.MeanReductionStrategy.Running,),
     "Training.meanAccumulationAndReplicationReductionStrategy",
     poptorch.MeanReductionStrategy.Running),
    ("Training.setAutomaticLossScaling", (True,), "Training.automatic_loss_scaling", True),
    ("Training.setConvolutionDithering", (True,), "Training.convolution_dithering", True),
    ("Precision.halfFloatCasting", (poptorch.HalfFloatCastingBehavior.FloatDowncastToHalf,),
     "Precision.half_float_casting", poptorch.HalfFloatCastingBehavior.FloatDowncastToHalf),
    ("Precision.runningStatisticsAlwaysFloat", (False,),
     "Precision.running_statistics_always_float", False),
    ("Precision.enableFloatingPointExceptions", (True,),
     "Precision.floating_point_exceptions", True),
    ("Precision.enableStochasticRounding", (True,), "Precision.stochastic_rounding", True),
    ("Precision.setPartialsType", (torch.half,), "Precision.partials_type", torch.float16),
    ("TensorLocations.numIOTiles", (64,), "TensorLocations.num_io_tiles", 64),
    ("TensorLocations.setActivationLocation", (TLS().useOnChipStorage(False),),
     "TensorLocations.location_activation", {"onChip": False}),
    ("TensorLocations.setWeightLocation", (TLS().useReplicatedTensorSharding(),),
     "TensorLocations.location_weight", {"useReplicatedTensorSharding": True}),
    ("TensorLocations.setOptimizerLocation", (TLS().minElementsForOffChip(10),),
     "TensorLocations.location_optimizer", {"minElementsForOffChip": 10}),
    ("TensorLocations.setAccumulatorLocation", (TLS().useIOTilesToLoad().useIOTilesToStore(),),
     "TensorLocations.location_accumulator", {"useIOTilesToLoad": True,
                                              "useIOTilesToStore": True}),
    ("Jit.traceModel", (True,), "Jit.trace_model", True),
    ("Jit.backend", ("eager",), "Jit.backend", "eager"),
    ("Distributed.configureProcessId", (1, 4), "Distributed.distributed_process_id", 1),
    ("Distributed.configureProcessId", (1, 4), "Distributed.num_distributed_processes", 4),
    ("_Popart.set", ("autoRecomputation", 3), "_Popart.autoRecomputation", 3),
    ("_Popart.setPatterns", ({"PadSum": True},), "_Popart.patterns", {"PadSum": True}),
    ("_Popart.setEngineOptions", ({"debug.x": "1"},), "_Popart.engineOptions",
     {"debug.x": "1"}),
]


@pytest.mark.parametrize("setter,args,key,expected", VALID,
                         ids=[f"{v[0]}-{i}" for i, v in enumerate(VALID)])
def test_valid_setter_round_trips_through_toDict(setter, args, key, expected):
    opts = poptorch.Options()
    returned = _call(opts, setter, args)
    owner = opts
    for part in setter.split(".")[:-1]:
        owner = getattr(owner, part)
    assert returned is owner, "setters are chainable: they return their options object"
    assert _lookup(opts.toDict(), key) == expected
    if "." not in key:
        assert getattr(opts, key) == expected  # attribute access to the same value


# (setter, args, words the error message must contain)
INVALID = [
    ("deviceIterations", (0,), ["deviceIterations", ">= 1"]),
    ("deviceIterations", (2.0,), ["deviceIterations", "integer"]),
    ("deviceIterations", (True,), ["deviceIterations", "integer"]),
    ("replicationFactor", (-1,), ["replicationFactor", ">= 1"]),
    ("inputReplicaGrouping", (0, poptorch.CommGroupType.Consecutive), ["input_group_size"]),
    ("inputReplicaGrouping", (2, poptorch.CommGroupType.All), ["CommGroupType.Consecutive"]),
    ("broadcastBuffers", (1,), ["broadcastBuffers", "True or False"]),
    ("outputMode", (7,), ["outputMode", "OutputMode.All"]),
    ("outputMode", ("Everything",), ["outputMode", "OutputMode.EveryN"]),
    ("outputMode", (poptorch.OutputMode.EveryN,), ["output_return_period"]),
    ("outputMode", (poptorch.OutputMode.EveryN, 0), ["output_return_period", ">= 1"]),
    ("anchorTensor", (1, "x"), ["short_name", "string"]),
    ("anchorTensor", ("a", "x", "bogus"), ["output_mode"]),
    ("autoRoundNumIPUs", ("yes",), ["autoRoundNumIPUs"]),
    ("useIpuModel", (None,), ["useIpuModel"]),
    ("useIpuId", (-1,), ["useIpuId", ">= 0"]),
    ("useOfflineIpuTarget", (3,), ["1, 2, 21", "ipuHardwareVersion"]),
    ("connectionType", (poptorch.SyncPattern.Full,), ["connectionType", "ConnectionType"]),
    ("syncPattern", (9,), ["syncPattern", "SyncPattern.Full"]),
    ("setAvailableMemoryProportion", (0.5,), ["dict"]),
    ("setAvailableMemoryProportion", ({"GPU0": 0.5},), ["'IPU0'"]),
    ("setAvailableMemoryProportion", ({"IPU0": 1.5},), ["[0, 1]"]),
    ("randomSeed", (-3,), ["randomSeed", ">= 0"]),
    ("randomSeed", (1.5,), ["randomSeed", "integer"]),
    ("enableSyntheticData", (torch.ones(2),), ["enableSyntheticData", "truth value"]),
    ("enableStableNorm", (1,), ["enableStableNorm"]),
    ("updatableNamedBuffers", ("buf",), ["updatableNamedBuffers", "list of strings"]),
    ("updatableNamedBuffers", ([1],), ["updatableNamedBuffers", "string"]),
    ("relaxOptimizerAttributesChecks", (torch.ones(2),), ["relaxOptimizerAttributesChecks"]),
    ("showCompilationProgressBar", (torch.ones(2),), ["showCompilationProgressBar"]),
    ("enableExecutableCaching", (3,), ["enableExecutableCaching"]),
    ("enableProfiling", (3,), ["enableProfiling"]),
    ("modelName", (None,), ["modelName"]),
    ("logDir", (None,), ["logDir"]),
    ("maxRepeatLogs", (-1,), ["maxRepeatLogs", ">= 0"]),
    ("logCycleCount", ("x",), ["logCycleCount"]),
    ("sourceLocationExcludes", ("a",), ["sourceLocationExcludes"]),
    ("appendToLocationExcludes", (1,), ["appendToLocationExcludes"]),
    ("Training.gradientAccumulation", (0,), ["Training.gradientAccumulation", ">= 1"]),
    ("Training.accumulationAndReplicationReductionType", (poptorch.ReductionType.NoReduction,),
     ["ReductionType.Sum", "ReductionType.Mean"]),
    ("Training.setMeanAccumulationAndReplicationReductionStrategy", ("Pre",),
     ["MeanReductionStrategy.Running"]),
    ("Training.setAutomaticLossScaling", (1,), ["setAutomaticLossScaling"]),
    ("Training.setConvolutionDithering", ("on",), ["setConvolutionDithering"]),
    ("Precision.halfFloatCasting", (5,), ["halfFloatCasting"]),
    ("Precision.runningStatisticsAlwaysFloat", (None,), ["runningStatisticsAlwaysFloat"]),
    ("Precision.enableFloatingPointExceptions", (1,), ["enableFloatingPointExceptions"]),
    ("Precision.enableStochasticRounding", (1,), ["enableStochasticRounding"]),
    ("Precision.setPartialsType", (torch.bfloat16,), ["torch.float or torch.half"]),
    ("TensorLocations.numIOTiles", (16,), ["numIOTiles", "between 32 and 192"]),
    ("TensorLocations.numIOTiles", (33,), ["numIOTiles", "even"]),
    ("TensorLocations.numIOTiles", (194,), ["numIOTiles", "between 32 and 192"]),
    ("TensorLocations.setActivationLocation", ({"onChip": False},),
     ["TensorLocationSettings"]),
    ("Jit.traceModel", (torch.ones(2),), ["traceModel"]),
    ("Jit.backend", ("xla",), ["Jit.backend", "'eager'", "'inductor'"]),
    ("Distributed.configureProcessId", (2, 2), ["process_id", "<= 1"]),
    ("Distributed.configureProcessId", (0, 0), ["num_processes", ">= 1"]),
    ("_Popart.set", (1, 2), ["_Popart.set", "string"]),
    ("_Popart.setPatterns", ([],), ["setPatterns", "dict"]),
    ("_Popart.setEngineOptions", ("x",), ["setEngineOptions", "dict"]),
]


@pytest.mark.parametrize("setter,args,words", INVALID,
                         ids=[f"{v[0]}-{i}" for i, v in enumerate(INVALID)])
def test_invalid_setter_value_raises_clear_error(setter, args, words):
    opts = poptorch.Options()
    before = opts.toDict()
    with pytest.raises(poptorch.Error) as info:
        _call(opts, setter, args)
    for word in words:
        assert word in str(info.value)
    assert opts.toDict() == before, "a rejected value leaves the options unchanged"


@pytest.mark.parametrize("method,args,key,expected", [
    ("minElementsForOffChip", (5,), "minElementsForOffChip", 5),
    ("minElementsForReplicatedTensorSharding", (7,), "minElementsForReplicatedTensorSharding",
     7),
    ("useOnChipStorage", (), "onChip", True),
    ("useReplicatedTensorSharding", (False,), "useReplicatedTensorSharding", False),
    ("useIOTilesToLoad", (), "useIOTilesToLoad", True),
    ("useIOTilesToStore", (False,), "useIOTilesToStore", False),
])
def test_tensor_location_settings(method, args, key, expected):
    settings = TLS()
    assert getattr(settings, method)(*args) is settings
    assert settings.toDict() == {key: expected}
    with pytest.raises(poptorch.Error, match=method):
        getattr(settings, method)("bad")


def test_use_on_chip_storage_none_removes_the_setting():
    settings = TLS().useOnChipStorage(False)
    settings.useOnChipStorage(None)
    assert not settings.exists("onChip")


def test_defaults_match_upstream():
    opts = poptorch.Options()
    assert opts.device_iterations == 1 and opts.replication_factor == 1
    assert opts.output_mode == poptorch.OutputMode.Default.value and opts.defaultOutputMode()
    assert opts.output_return_period == 1 and opts.anchored_tensors == {}
    assert opts.input_group_size == 1 and opts.input_cgt == poptorch.CommGroupType.Consecutive
    assert opts.broadcast_buffers is True and opts.auto_round_num_ipus is False
    assert opts.connection_type == poptorch.ConnectionType.Always.value
    assert opts.sync_pattern == poptorch.SyncPattern.Full.value
    assert opts.log_dir == "." and opts.max_repeat_logs == 4
    assert opts.execution_strategy is None
    assert opts.show_compilation_progress_bar is True
    assert opts.relax_optimizer_attributes_checks is False
    assert not opts.exists("random_seed") and not opts.exists("ipu_id")
    assert not opts.exists("use_model") and not opts.exists("model_name")
    assert opts.Training.gradient_accumulation == 1
    assert opts.Training.accumulation_and_replication_reduction_type == poptorch.ReductionType.Mean
    assert (opts.Training.meanAccumulationAndReplicationReductionStrategy
            == poptorch.MeanReductionStrategy.Post)
    assert opts.Training.automatic_loss_scaling is False
    assert opts.Distributed.processId == 0 and opts.Distributed.numProcesses == 1
    for kind in ("activation", "weight", "optimizer", "accumulator"):
        assert getattr(opts.TensorLocations, f"location_{kind}") == {}
    assert opts._ignored_options() == {}


def test_default_output_mode_false_once_set():
    opts = poptorch.Options().outputMode(poptorch.OutputMode.All)
    assert not opts.defaultOutputMode()


def test_options_dict_methods():
    settings = TLS(minElementsForOffChip=3)
    assert settings("minElementsForOffChip") == 3
    assert settings.exists("minElementsForOffChip") and not settings.exists("onChip")
    settings.set(minElementsForOffChip=4)
    assert settings("minElementsForOffChip") == 4
    with pytest.raises(poptorch.Error, match="Unknown option 'onChip'"):
        settings.set(onChip=True)
    settings.createOrSet(onChip=True)
    settings.update({"useIOTilesToLoad": True})
    assert settings.toDict() == {"minElementsForOffChip": 4, "onChip": True,
                                 "useIOTilesToLoad": True}
    settings.deleteIfExists("onChip")
    settings.deleteIfExists("onChip")  # absent: no error
    assert not settings.exists("onChip")
    with pytest.raises(AttributeError, match="nothing"):
        settings("nothing")
    assert "minElementsForOffChip=4" in repr(settings)


def test_values_are_read_only_attributes():
    opts = poptorch.Options()
    with pytest.raises(AttributeError, match="setter"):
        opts.output_mode = 2  # no single-value setter: read-only
    assert opts.output_mode == poptorch.OutputMode.Default.value
    with pytest.raises(AttributeError, match="no attribute or option 'not_an_option'"):
        _ = opts.not_an_option


def test_repr_shows_values_and_sub_objects():
    opts = poptorch.Options().deviceIterations(3)
    opts.Training.gradientAccumulation(5)
    text = repr(opts)
    assert text.startswith("Options(") and "device_iterations=3" in text
    assert "Training=_TrainingOptions(" in text and "gradient_accumulation=5" in text


# -- freezing and cloning --------------------------------------------------------------
@pytest.mark.parametrize("setter,args", [
    ("deviceIterations", (2,)), ("Training.gradientAccumulation", (2,)),
    ("Precision.enableStochasticRounding", (True,)), ("Jit.backend", ("eager",)),
    ("TensorLocations.setWeightLocation", (TLS(),)), ("Distributed.disable", ()),
    ("_Popart.set", ("a", 1)), ("randomSeed", (1,)),
])
def test_frozen_options_refuse_changes(setter, args):
    opts = poptorch.Options()
    opts._freeze()
    with pytest.raises(poptorch.Error) as info:
        _call(opts, setter, args)
    message = str(info.value)
    assert "frozen" in message and "DataLoader uses them" in message \
        and "opts.clone()" in message


def test_clone_is_an_unfrozen_deep_copy():
    opts = poptorch.Options().deviceIterations(3)
    opts.Training.gradientAccumulation(2)
    opts.anchorTensor("a", "b")
    opts._freeze()
    clone = opts.clone()
    clone.deviceIterations(4).anchorTensor("c", "d")
    clone.Training.gradientAccumulation(6)
    clone._Popart.set("x", 1)
    assert opts.device_iterations == 3 and opts.Training.gradient_accumulation == 2
    assert list(opts.anchored_tensors) == ["a"] and opts._Popart.options == {}
    assert clone.device_iterations == 4 and clone.Training.gradient_accumulation == 6
    copied = copy.deepcopy(opts)  # a copy is for changing: unfrozen too (upstream)
    assert copied.toDict() == opts.toDict()
    copied.deviceIterations(5)
    copied.Training.gradientAccumulation(4)
    copied._Popart.set("y", 2)
    assert opts.device_iterations == 3 and opts._Popart.options == {}


def test_a_data_loader_freezes_its_options():
    """The loader reads its batching from the options when it is built, so later changes
    would silently not reach it: they raise, as after wrapping a model."""
    opts = poptorch.Options().deviceIterations(2)
    dataset = torch.utils.data.TensorDataset(torch.arange(12.0))
    loader = poptorch.DataLoader(opts, dataset, batch_size=3)
    for change in (lambda: opts.deviceIterations(4),
                   lambda: loader.options.Training.gradientAccumulation(2),
                   lambda: loader.options._Popart.set("x", 1)):
        with pytest.raises(poptorch.Error, match="frozen"):
            change()
    assert [b.tolist() for (b,) in loader] == [[0., 1., 2., 3., 4., 5.],
                                                [6., 7., 8., 9., 10., 11.]]
    # a clone is free to change and builds a loader of its own
    other = poptorch.DataLoader(opts.clone().deviceIterations(1), dataset, batch_size=3)
    assert len(other) == 4 and len(loader) == 2
    # arguments refused before the loader exists leave the options unfrozen
    fresh = poptorch.Options()
    with pytest.raises(ValueError):
        poptorch.DataLoader(fresh, dataset, batch_size=3, num_workers=-1)
    fresh.deviceIterations(3)


def test_check_is_frozen():
    opts = poptorch.Options()
    opts.checkIsFrozen()
    opts._freeze()
    with pytest.raises(poptorch.Error, match="device_iterations"):
        opts.checkIsFrozen("device_iterations")


# -- ignored options -------------------------------------------------------------------
def test_ignored_options_are_reported_and_logged_once(caplog, monkeypatch):
    # start from an empty "already logged" registry: other tests may have logged these
    monkeypatch.setattr(poptorch._logging, "_once_keys", set())
    # (connectionType(Never), which useOfflineIpuTarget sets, has an effect: no run)
    opts = poptorch.Options().connectionType(poptorch.ConnectionType.OnDemand)
    opts.enableStableNorm(True).logCycleCount(True)
    opts.createOrSet(ipu_version=2)  # the version useOfflineIpuTarget(2) records
    opts.setAvailableMemoryProportion({"IPU0": 0.2}).disableModuleNamescope()
    opts.sourceLocationExcludes(["x"]).syncPattern(poptorch.SyncPattern.ReplicaAndLadder)
    opts.Training.setConvolutionDithering(True)
    opts.TensorLocations.numIOTiles(32)
    opts.TensorLocations.setWeightLocation(TLS().useReplicatedTensorSharding()
                                           .useOnChipStorage(False))
    opts.Jit.traceModel(True)
    opts._Popart.set("virtualGraphMode", 1)
    expected = {
        "connection_type": 1, "enable_stable_norm": True, "log_cycle_count": True,
        "ipu_version": 2, "available_memory_proportion": {"IPU0": 0.2},
        "module_namescope": False, "source_location_excludes": ["x"], "sync_pattern": 2,
        "Training.convolution_dithering": True, "TensorLocations.num_io_tiles": 32,
        "Jit.trace_model": True, "_Popart.virtualGraphMode": 1,
    }
    assert opts._ignored_options() == expected
    poptorch.setLogLevel("INFO")
    try:
        with caplog.at_level(logging.INFO, logger="poptorch::python"):
            opts._apply_effects()
            opts.clone()._apply_effects()  # same options again: not logged twice
    finally:
        poptorch.setLogLevel("WARN")
    logged = [r.getMessage() for r in caplog.records if "has no effect and is ignored" in r.getMessage()]
    assert len(logged) == len(expected)
    assert any("connection_type=1" in m for m in logged)


def test_meaningful_options_are_not_reported_as_ignored():
    opts = poptorch.Options().deviceIterations(2).replicationFactor(2).randomSeed(1)
    opts.Training.gradientAccumulation(2).setAutomaticLossScaling(True)
    opts.Precision.enableStochasticRounding(True)
    opts.TensorLocations.setActivationLocation(TLS().useOnChipStorage(False))
    # (weights / accumulators RTS: sharded over the processes, _runtime/memory/)
    opts.TensorLocations.setWeightLocation(TLS().useReplicatedTensorSharding(True))
    opts.TensorLocations.setAccumulatorLocation(TLS().useReplicatedTensorSharding(True))
    opts.Jit.backend("eager")
    assert opts._ignored_options() == {}


# -- specific behaviours ---------------------------------------------------------------
def test_random_seed_seeds_torch_like_manual_seed():
    torch.manual_seed(123)
    reference = torch.rand(5)
    torch.manual_seed(0)
    poptorch.Options().randomSeed(123)
    assert torch.equal(torch.rand(5), reference)


def test_execution_strategy_must_be_a_strategy():
    opts = poptorch.Options()
    strategy = poptorch.ShardedExecution()
    assert opts.setExecutionStrategy(strategy) is opts
    assert opts.execution_strategy is strategy
    with pytest.raises(poptorch.Error, match="PipelinedExecution"):
        opts.setExecutionStrategy("pipelined")


def test_strategies_reexported_from_options_module():
    for name in ("Stage", "Phase", "PipelinedExecution", "ShardedExecution",
                 "SerialPhasedExecution", "ParallelPhasedExecution", "BlockId"):
        assert getattr(poptorch.options, name) is getattr(poptorch, name)
    assert poptorch.options.Options is poptorch.Options
    assert poptorch.options.ConfigFileError is poptorch.ConfigFileError


def test_anchor_tensor_accumulates():
    opts = poptorch.Options().anchorTensor("a", "x").anchorTensor("b", "y",
                                                                  poptorch.OutputMode.Sum)
    assert set(opts.anchored_tensors) == {"a", "b"}
    assert opts.anchored_tensors["b"]["output_mode"] == poptorch.OutputMode.Sum.value


def test_jit_backend_reads_as_name_and_env(monkeypatch):
    monkeypatch.delenv("POPTORCH_BACKEND", raising=False)
    opts = poptorch.Options()
    assert opts.Jit.backend == None  # noqa: E711  (automatic: falsy and == None)
    assert not opts.Jit.backend and opts.Jit.backend_name is None
    monkeypatch.setenv("POPTORCH_BACKEND", "Inductor")
    assert opts.Jit.backend == "inductor" and opts.Jit.backend_name == "inductor"
    opts.Jit.backend("eager")  # explicit wins over the environment
    assert opts.Jit.backend == "eager" and isinstance(opts.Jit.backend, str)
    opts.Jit.backend(None)
    assert opts.Jit.backend == "inductor"
    monkeypatch.setenv("POPTORCH_BACKEND", "tvm")
    with pytest.raises(poptorch.Error, match="POPTORCH_BACKEND"):
        _ = poptorch.Options().Jit.backend_name


def test_cache_dir_env(monkeypatch, tmp_path):
    monkeypatch.setenv("POPTORCH_CACHE_DIR", str(tmp_path))
    assert poptorch.Options().executable_cache_dir == str(tmp_path)
    monkeypatch.delenv("POPTORCH_CACHE_DIR")
    assert poptorch.Options().executable_cache_dir is None


def test_distributed_env_vars(monkeypatch):
    for var in ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "WORLD_SIZE", "RANK"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "2")
    dist = poptorch.Options().Distributed
    assert (dist.processId, dist.numProcesses) == (2, 4)
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "8")
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "5")
    dist = poptorch.Options().Distributed
    assert (dist.processId, dist.numProcesses) == (5, 8)
    assert dist.disable() is dist and (dist.processId, dist.numProcesses) == (0, 1)
    monkeypatch.setenv("MY_N", "3")
    monkeypatch.setenv("MY_ID", "1")
    dist.setEnvVarNames("MY_N", "MY_ID")
    assert (dist.processId, dist.numProcesses) == (1, 3)
    monkeypatch.setenv("MY_ID", "one")
    with pytest.raises(poptorch.Error, match="MY_ID"):
        dist.setEnvVarNames("MY_N", "MY_ID")


def test_attribute_records_attributes():
    from poptorch.options.attribute import current_attributes
    assert current_attributes() == {}
    with poptorch.Attribute(__outline={"layer": "a"}, x=1) as outer:
        assert isinstance(outer, poptorch.Attribute)
        with poptorch.Attribute(x=2):
            assert current_attributes() == {"__outline": {"layer": "a"}, "x": 2}
        assert current_attributes()["x"] == 1
    assert current_attributes() == {}


def test_popart_options_object():
    popart = _PopartOptions()
    popart.set("a", 1).setPatterns({"P": False}, 0)
    assert popart.options == {"a": 1, "patterns": {"P": False}, "patternsLevel": 0}


# -- config files ----------------------------------------------------------------------
def test_load_from_file(tmp_path):
    cfg = tmp_path / "poptorch.conf"
    cfg.write_text(
        "# a comment\n"
        "\n"
        "deviceIterations(32)\n"
        "replicationFactor(2)  # trailing comment\n"
        "Training.gradientAccumulation(4)\n"
        "outputMode(poptorch.OutputMode.EveryN, output_return_period=2)\n"
        "anchorMode(AnchorMode.Sum)\n"
        "Precision.setPartialsType(torch.half)\n"
        "TensorLocations.setActivationLocation("
        "poptorch.TensorLocationSettings().useOnChipStorage(False))\n"
        "_Popart.set('autoRecomputation', 3)\n"
        "setAvailableMemoryProportion({'IPU0': 0.5})\n"
        "   Jit.backend('eager')\n")
    cfg2 = tmp_path / "c2.cfg"
    cfg2.write_text("deviceIterations(4)\n")
    opts = poptorch.Options().loadFromFile(str(cfg)).loadFromFile(str(cfg2))
    expected = poptorch.Options().deviceIterations(4).replicationFactor(2)
    expected.Training.gradientAccumulation(4)
    expected.outputMode(poptorch.OutputMode.Sum)
    expected.Precision.setPartialsType(torch.half)
    expected.TensorLocations.setActivationLocation(TLS().useOnChipStorage(False))
    expected._Popart.set("autoRecomputation", 3)
    expected.setAvailableMemoryProportion({"IPU0": 0.5})
    expected.Jit.backend("eager")
    assert opts.toDict() == expected.toDict()


@pytest.mark.parametrize("line,reason", [
    ("deviceIterations(0)", ">= 1"),
    ("deviceIteration(2)", "Unknown option setter 'deviceIteration'"),
    ("deviceIterations(2", "not a valid Python expression"),
    ("deviceIterations = 2", "not a valid Python expression"),
    ("device_iterations", "setter call"),
    ("Nonsense.gradientAccumulation(2)", "not an options category"),
    ("deviceIterations(__import__('os').getpid())", "unknown name '__import__'"),
    ("deviceIterations(1 if True else 2)", "unsupported expression"),
    ("deviceIterations(x)", "unknown name 'x'"),
    ("outputMode(poptorch.OutputMode.Bogus)", "unknown name"),
    ("loadFromFile('other.cfg')", "not an option setter"),
    ("set(device_iterations=0)", "not an option setter"),
    ("_freeze()", "not an option setter"),
    ("Training.__class__()", "not an option setter"),
])
def test_load_from_file_bad_line(tmp_path, line, reason):
    cfg = tmp_path / "bad.cfg"
    cfg.write_text(f"# header\ndeviceIterations(2)\n{line}\n")
    opts = poptorch.Options()
    with pytest.raises(poptorch.ConfigFileError) as info:
        opts.loadFromFile(str(cfg))
    message = str(info.value)
    assert f"{cfg}:3" in message and reason in message
    assert opts.device_iterations == 2  # lines before the bad one were applied


def test_from_json():
    opts = poptorch.Options().from_json(
        '{"Precision.enableFloatingPointExceptions": true, "_Popart.set": ["OptionName", 1],'
        ' "deviceIterations": 3, "outputMode": "All", "Training.gradientAccumulation": 2}')
    assert opts.Precision.floating_point_exceptions is True
    assert opts._Popart.options == {"OptionName": 1}
    assert opts.device_iterations == 3 and opts.Training.gradient_accumulation == 2
    assert opts.output_mode == poptorch.OutputMode.All.value
    with pytest.raises(poptorch.Error, match="invalid JSON"):
        opts.from_json("{")
    with pytest.raises(poptorch.Error, match="Unknown option setter"):
        opts.from_json('{"nothing": 1}')
    with pytest.raises(poptorch.Error, match=">= 1"):
        opts.from_json('{"deviceIterations": 0}')


def test_enum_aliases():
    assert poptorch.AnchorMode is poptorch.OutputMode
    assert enums.OutputMode.EveryN.value == 1


def test_options_pickle_round_trip():
    import pickle
    opts = poptorch.Options().deviceIterations(3)
    opts.Training.gradientAccumulation(2)
    opts._Popart.set("a", 1)
    opts.Jit.backend("eager")
    opts._freeze()
    restored = pickle.loads(pickle.dumps(opts))
    assert restored.toDict() == opts.toDict()
    assert restored.Jit.backend == "eager"
    with pytest.raises(poptorch.Error, match="frozen"):
        restored.deviceIterations(1)


def test_poptorch_core_reexports_errors():
    from poptorch import poptorch_core
    assert poptorch_core.Error is poptorch.Error
    assert poptorch_core.RecoverableError is poptorch.RecoverableError
    assert poptorch_core.UnrecoverableError is poptorch.UnrecoverableError
    assert (poptorch_core.importPoptorchMetadataFromFile
            is poptorch.importPoptorchMetadataFromFile)


def test_toDict_lists_our_own_options_only_when_set():
    # issue 17: upstream's toDict has no such keys; optimum-graphcore compares the
    # dictionary with its IPUConfig, whose executable_cache_dir field would then collide
    from poptorch.options.options import _OWN_OPTION_DEFAULTS
    opts = poptorch.Options()
    assert set(_OWN_OPTION_DEFAULTS) <= set(opts._values)  # every name is a real option
    assert not set(_OWN_OPTION_DEFAULTS) & set(opts.toDict())
    assert opts.toDict()["device_iterations"] == 1  # upstream's keys stay, defaults included
    opts.enableExecutableCaching("/tmp/cache").logCycleCount(True)
    d = opts.toDict()
    assert d["executable_cache_dir"] == "/tmp/cache" and d["log_cycle_count"] is True
    assert opts.executable_cache_dir == "/tmp/cache"


@pytest.mark.parametrize("tiles", [10, 33, 193, 194])
def test_num_io_tiles_limits_raise_poptorch_error_and_assertion_error(tiles):
    # PopTorch raises AssertionError here; ours is also a poptorch.Error
    with pytest.raises(AssertionError, match="even number between 32 and 192"):
        poptorch.Options().TensorLocations.numIOTiles(tiles)
    for ok in (32, 100, 192):
        opts = poptorch.Options()
        opts.TensorLocations.numIOTiles(ok)
        assert opts.TensorLocations.num_io_tiles == ok


def test_assigning_an_option_goes_through_its_setter():
    assigned, called = poptorch.Options(), poptorch.Options()
    assigned.replication_factor = 4
    assigned.device_iterations = 3
    assigned.random_seed = 7
    assigned.Training.gradient_accumulation = 2
    called.replicationFactor(4).deviceIterations(3).randomSeed(7)
    called.Training.gradientAccumulation(2)
    assert assigned.toDict() == called.toDict()
    assert "replication_factor" not in vars(assigned)  # stored as an option, not shadowed
    with pytest.raises(poptorch.Error, match="deviceIterations"):
        assigned.device_iterations = 0
    assert assigned.device_iterations == 3
    with pytest.raises(AttributeError, match="read-only"):
        assigned.output_mode = 1
    assigned._freeze()
    with pytest.raises(poptorch.Error, match="frozen"):
        assigned.replication_factor = 2
    # a model wrapped with assigned options runs like one wrapped with the setters' options
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    x = torch.randn(2 * 4 * 3, 3)
    out = poptorch.inferenceModel(model, poptorch.Options().deviceIterations(3)
                                  .replicationFactor(4))(x)
    opts = poptorch.Options()
    opts.device_iterations, opts.replication_factor = 3, 4
    assert torch.equal(poptorch.inferenceModel(model, opts)(x), out)
    assert torch.equal(out, model(x))
