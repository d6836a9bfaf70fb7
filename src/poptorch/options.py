"""``poptorch.Options``: every option controlling how a model is compiled and run.

Options objects are configuration only: setters validate their arguments and record
them; the executor and the runtime read the recorded values (see docs/options.md for
which module applies each option, and for the options that have no meaning on our
devices). Setters return the object they belong to, so calls chain::

    opts = poptorch.Options().deviceIterations(4).replicationFactor(2)
    opts.Training.gradientAccumulation(8)
"""
from __future__ import annotations

import ast
import copy
import json
import os
from typing import Any, Callable

import torch

from . import _logging
from . import enums
from ._options_base import (OptionsDict, check_bool, check_enum, check_int, check_str)
from .errors import ConfigFileError, Error

__all__ = ["Options", "TensorLocationSettings", "Attribute", "BlockId", "ConfigFileError",
           "Stage", "Phase", "PipelinedExecution", "ShardedExecution",
           "SerialPhasedExecution", "ParallelPhasedExecution"]

BlockId = str
"""Identifier of a block (the ``user_id`` of :py:class:`poptorch.Block`)."""

_BACKENDS = ("eager", "inductor")
_DEFAULT_SOURCE_LOCATION_EXCLUDES = ["install/poptorch", "site-packages/torch",
                                     "site-packages/poptorch"]


def _check_optional_path(option: str, value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    return check_str(option, value)


def _check_str_list(option: str, value: Any) -> list[str]:
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise Error(f"{option}: expected a list of strings, got {value!r}.")
    for item in value:
        check_str(option, item)
    return list(value)


# --------------------------------------------------------------------------------------
class _JitOptions(OptionsDict):
    """Options related to capturing and compiling the model.

    Can be accessed via :py:attr:`poptorch.Options.Jit`:

    >>> opts = poptorch.Options()
    >>> opts.Jit.backend("eager")
    """

    def __init__(self) -> None:
        super().__init__(trace_model=False, backend=None)

    def traceModel(self, trace_model: bool) -> "_JitOptions":
        """Upstream: trace the model with ``torch.jit.trace`` (deprecated). Recorded only:
        models are always captured the same way here."""
        self.set(trace_model=check_bool("Jit.traceModel", trace_model))
        return self

    @property
    def backend(self) -> "_BackendName | _AutoBackend":
        """The compiler backend: ``"eager"``, ``"inductor"`` or automatic.

        Reads as the chosen backend name (a ``str``: ``opts.Jit.backend == "eager"``);
        call it to choose one (``opts.Jit.backend("inductor")``, ``None`` for
        automatic). When not chosen explicitly, the ``POPTORCH_BACKEND`` environment
        variable decides; otherwise it is automatic: falsy and ``== None`` (but not
        ``is None``), and the executor picks inductor on GPUs and eager on the CPU. Use
        :py:attr:`backend_name` to read a plain ``str`` or ``None``.
        """
        name = self.backend_name
        return _AutoBackend(self) if name is None else _BackendName(name, self)

    @property
    def backend_name(self) -> str | None:
        """The chosen backend as a plain value: explicit, else ``POPTORCH_BACKEND``,
        else None (automatic)."""
        explicit = self._values["backend"]
        if explicit is not None:
            return explicit
        env = os.environ.get("POPTORCH_BACKEND")
        if env is None or env.strip() == "" or env.strip().lower() == "auto":
            return None
        name = env.strip().lower()
        if name not in _BACKENDS:
            raise Error(f"POPTORCH_BACKEND environment variable: unknown backend {env!r}; "
                        f"use one of {', '.join(_BACKENDS)} (or unset it).")
        return name

    def _set_backend(self, name: str | None) -> "_JitOptions":
        if name is not None:
            if not isinstance(name, str) or name.lower() not in _BACKENDS:
                raise Error(f"Jit.backend: expected one of {', '.join(map(repr, _BACKENDS))} "
                            f"or None (automatic), got {name!r}.")
            name = name.lower()
        self.set(backend=name)
        return self

    def _ignored(self) -> dict[str, Any]:
        return {"Jit.trace_model": True} if self._values["trace_model"] else {}


class _BackendName(str):
    """``opts.Jit.backend`` once a backend is chosen: the name itself (a real ``str``),
    callable to choose another one."""

    def __new__(cls, name: str, jit: _JitOptions) -> "_BackendName":
        obj = super().__new__(cls, name)
        obj._jit = jit
        return obj

    def __call__(self, name: str | None) -> _JitOptions:
        return self._jit._set_backend(name)


class _AutoBackend:
    """``opts.Jit.backend`` while no backend is chosen: falsy and equal to None,
    callable to choose one."""

    __slots__ = ("_jit",)

    def __init__(self, jit: _JitOptions) -> None:
        self._jit = jit

    def __call__(self, name: str | None) -> _JitOptions:
        return self._jit._set_backend(name)

    def __eq__(self, other: object) -> bool:
        return other is None or isinstance(other, _AutoBackend)

    def __hash__(self) -> int:
        return hash(None)

    def __bool__(self) -> bool:
        return False

    def __repr__(self) -> str:
        return "None"


# --------------------------------------------------------------------------------------
class _PrecisionOptions(OptionsDict):
    """Options related to numerical precision.

    Can be accessed via :py:attr:`poptorch.Options.Precision`:

    >>> opts = poptorch.Options()
    >>> opts.Precision.enableFloatingPointExceptions(True)
    """

    def __init__(self, popart_options: "_PopartOptions | None" = None) -> None:
        super().__init__(half_float_casting=enums.HalfFloatCastingBehavior.Default,
                         running_statistics_always_float=True,
                         floating_point_exceptions=False,
                         stochastic_rounding=False,
                         partials_type=torch.float32)
        self._popart = popart_options

    def halfFloatCasting(self, half_float_casting: enums.HalfFloatCastingBehavior
                         ) -> "_PrecisionOptions":
        """How operations mixing float16 and float32 inputs are computed
        (``HalfUpcastToFloat``, PyTorch's type promotion, is the default)."""
        self.set(half_float_casting=check_enum("Precision.halfFloatCasting",
                                               half_float_casting,
                                               enums.HalfFloatCastingBehavior))
        return self

    def runningStatisticsAlwaysFloat(self, value: bool) -> "_PrecisionOptions":
        """Keep batch-norm running statistics in float32 even in a float16 model."""
        self.set(running_statistics_always_float=check_bool(
            "Precision.runningStatisticsAlwaysFloat", value))
        return self

    def enableFloatingPointExceptions(self, enabled: bool) -> "_PrecisionOptions":
        """Raise an error when an operation produces inf or NaN (overflow, 0/0, ...)."""
        self.set(floating_point_exceptions=check_bool(
            "Precision.enableFloatingPointExceptions", enabled))
        return self

    def enableStochasticRounding(self, enabled: bool) -> "_PrecisionOptions":
        """Round float16 results up or down at random, unbiased on average."""
        self.set(stochastic_rounding=check_bool("Precision.enableStochasticRounding",
                                                enabled))
        return self

    def setPartialsType(self, dtype: torch.dtype) -> "_PrecisionOptions":
        """Data type of the partial results of matmuls and convolutions:
        ``torch.float`` or ``torch.half``."""
        if dtype not in (torch.float32, torch.float16):
            raise Error(f"Precision.setPartialsType: expected torch.float or torch.half, "
                        f"got {dtype!r}.")
        self.set(partials_type=dtype)
        return self


# --------------------------------------------------------------------------------------
class _TrainingOptions(OptionsDict):
    """Options specific to model training.

    Can be accessed via :py:attr:`poptorch.Options.Training`:

    >>> opts = poptorch.Options()
    >>> opts.Training.gradientAccumulation(4)
    """

    def __init__(self, popart_options: "_PopartOptions | None" = None) -> None:
        super().__init__(
            gradient_accumulation=1,
            accumulation_and_replication_reduction_type=enums.ReductionType.Mean,
            meanAccumulationAndReplicationReductionStrategy=enums.MeanReductionStrategy.Post,
            automatic_loss_scaling=False,
            convolution_dithering=False)
        self._popart = popart_options

    def gradientAccumulation(self, gradient_accumulation: int) -> "_TrainingOptions":
        """Number of micro-batches whose gradients are accumulated before each
        optimizer update."""
        self.set(gradient_accumulation=check_int("Training.gradientAccumulation",
                                                 gradient_accumulation, minimum=1))
        return self

    def accumulationAndReplicationReductionType(
            self, reduction_type: enums.ReductionType) -> "_TrainingOptions":
        """How gradients of accumulated micro-batches and replicas are combined:
        ``ReductionType.Mean`` (default) or ``ReductionType.Sum``."""
        self.set(accumulation_and_replication_reduction_type=check_enum(
            "Training.accumulationAndReplicationReductionType", reduction_type,
            enums.ReductionType, (enums.ReductionType.Sum, enums.ReductionType.Mean)))
        return self

    def accumulationReductionType(self, reduction_type: enums.ReductionType
                                  ) -> "_TrainingOptions":
        """Old name (SDK 1.x / 2.0) of :py:meth:`accumulationAndReplicationReductionType`."""
        return self.accumulationAndReplicationReductionType(reduction_type)

    def setMeanAccumulationAndReplicationReductionStrategy(
            self, mean_reduction_strategy: enums.MeanReductionStrategy
    ) -> "_TrainingOptions":
        """When the mean reduction divides: ``Running``, ``Post`` or ``PostAndLoss``."""
        self.set(meanAccumulationAndReplicationReductionStrategy=check_enum(
            "Training.setMeanAccumulationAndReplicationReductionStrategy",
            mean_reduction_strategy, enums.MeanReductionStrategy))
        return self

    def setAutomaticLossScaling(self, enabled: bool) -> "_TrainingOptions":
        """Adjust the loss scale automatically during training (float16 models)."""
        self.set(automatic_loss_scaling=check_bool("Training.setAutomaticLossScaling",
                                                   enabled))
        return self

    def setConvolutionDithering(self, enabled: bool) -> "_TrainingOptions":
        """Upstream: spread convolutions over different tiles. Recorded only."""
        self.set(convolution_dithering=check_bool("Training.setConvolutionDithering",
                                                  enabled))
        return self

    def _ignored(self) -> dict[str, Any]:
        if self._values["convolution_dithering"]:
            return {"Training.convolution_dithering": True}
        return {}


# --------------------------------------------------------------------------------------
class _PopartOptions:
    """Options of upstream's PopART backend (``opts._Popart.set(name, value)``).

    There is no PopART here: the values are accepted and recorded, reported by
    ``Options._ignored_options()`` and logged once at INFO when a model is compiled.
    """

    def __init__(self) -> None:
        self.options: dict[str, Any] = {}
        self._frozen = False

    def checkIsFrozen(self, option: str | None = None) -> None:
        """Raise :py:class:`poptorch.Error` if these options can no longer change."""
        if self._frozen:
            what = f"option '_Popart.{option}'" if option else "them"
            raise Error(f"Options are frozen: a model has been compiled with them, so "
                        f"changing {what} would not take effect. Use opts.clone() to get "
                        f"an unfrozen copy.")

    def set(self, key: str, value: Any) -> "_PopartOptions":
        """Record the PopART session option ``key``."""
        check_str("_Popart.set", key)
        self.checkIsFrozen(key)
        self.options[key] = value
        return self

    def setEngineOptions(self, engine_options: dict) -> "_PopartOptions":
        """Record Poplar engine options."""
        if not isinstance(engine_options, dict):
            raise Error(f"_Popart.setEngineOptions: expected a dict, got {engine_options!r}.")
        return self.set("engineOptions", dict(engine_options))

    def setPatterns(self, patterns: dict, level: int = 2) -> "_PopartOptions":
        """Record PopART pattern overrides (``{name: enabled}``) and the pattern level."""
        if not isinstance(patterns, dict):
            raise Error(f"_Popart.setPatterns: expected a dict of pattern name -> bool, "
                        f"got {patterns!r}.")
        check_int("_Popart.setPatterns level", level, minimum=0)
        self.set("patterns", dict(patterns))
        return self.set("patternsLevel", level)

    def toDict(self) -> dict[str, Any]:
        return copy.deepcopy(self.options)

    def _freeze(self) -> None:
        self._frozen = True

    def _unfreeze(self) -> None:
        self._frozen = False

    def _ignored(self) -> dict[str, Any]:
        return {f"_Popart.{key}": value for key, value in self.options.items()}

    def __repr__(self) -> str:
        return f"_PopartOptions({self.options!r})"


# --------------------------------------------------------------------------------------
class _DistributedOptions(OptionsDict):
    """Options related to running over several processes.

    ``processId`` / ``numProcesses`` come from ``configureProcessId``, else from the
    OpenMPI variables ``OMPI_COMM_WORLD_RANK`` / ``OMPI_COMM_WORLD_SIZE`` (upstream's
    default), else from torchrun's ``RANK`` / ``WORLD_SIZE``.

    >>> opts = poptorch.Options()
    >>> opts.Distributed.configureProcessId(0, 2)
    """

    def __init__(self) -> None:
        super().__init__(num_distributed_processes=1, distributed_process_id=0,
                         ipuof_configs={})
        if "OMPI_COMM_WORLD_SIZE" in os.environ or "OMPI_COMM_WORLD_RANK" in os.environ:
            self.setEnvVarNames("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK")
        elif "WORLD_SIZE" in os.environ or "RANK" in os.environ:
            self.setEnvVarNames("WORLD_SIZE", "RANK")

    def disable(self) -> "_DistributedOptions":
        """Ignore the environment and run as a single process."""
        self.set(num_distributed_processes=1, distributed_process_id=0)
        return self

    def setEnvVarNames(self, var_num_processes: str,
                       var_process_id: str) -> "_DistributedOptions":
        """Read ``numProcesses`` and ``processId`` from these environment variables."""
        values = []
        for var, default in ((var_num_processes, "1"), (var_process_id, "0")):
            check_str("Distributed.setEnvVarNames", var)
            raw = os.environ.get(var, default)
            try:
                values.append(int(raw))
            except ValueError:
                raise Error(f"Distributed.setEnvVarNames: environment variable {var}="
                            f"{raw!r} is not an integer.") from None
        return self.configureProcessId(values[1], values[0])

    def configureProcessId(self, process_id: int,
                           num_processes: int) -> "_DistributedOptions":
        """Set this process's id and the total number of processes."""
        check_int("Distributed.configureProcessId num_processes", num_processes, minimum=1)
        check_int("Distributed.configureProcessId process_id", process_id, minimum=0,
                  maximum=num_processes - 1)
        self.set(distributed_process_id=process_id, num_distributed_processes=num_processes)
        return self

    @property
    def processId(self) -> int:
        """Id of the current process."""
        return self._values["distributed_process_id"]

    @property
    def numProcesses(self) -> int:
        """Total number of processes the execution is distributed over."""
        return self._values["num_distributed_processes"]


# --------------------------------------------------------------------------------------
# Settings in a TensorLocationSettings dict that have no meaning on our devices.
_IGNORED_LOCATION_KEYS = ("useReplicatedTensorSharding",
                          "minElementsForReplicatedTensorSharding",
                          "useIOTilesToLoad", "useIOTilesToStore")


class TensorLocationSettings(OptionsDict):
    """Where a kind of tensor is stored.

    >>> opts = poptorch.Options()
    >>> opts.TensorLocations.setActivationLocation(
    ...     poptorch.TensorLocationSettings().useOnChipStorage(False))

    ``onChip=False`` (off-chip, "streaming memory") and ``minElementsForOffChip`` are
    applied by phased execution: such tensors live in host memory between phases.
    Replicated tensor sharding and IO tiles are recorded only.
    """

    def minElementsForOffChip(self, min_elements: int) -> "TensorLocationSettings":
        """Tensors with fewer elements than this are never stored off chip."""
        self.createOrSet(minElementsForOffChip=check_int(
            "TensorLocationSettings.minElementsForOffChip", min_elements, minimum=0))
        return self

    def minElementsForReplicatedTensorSharding(self, min_elements: int
                                               ) -> "TensorLocationSettings":
        """Only shard tensors with more elements than this (recorded only)."""
        self.createOrSet(minElementsForReplicatedTensorSharding=check_int(
            "TensorLocationSettings.minElementsForReplicatedTensorSharding", min_elements,
            minimum=0))
        return self

    def useOnChipStorage(self, use: bool | None = True) -> "TensorLocationSettings":
        """True: device memory; False: off chip (host memory); None: undefined."""
        if use is None:
            self.deleteIfExists("onChip")
        else:
            self.createOrSet(onChip=check_bool("TensorLocationSettings.useOnChipStorage",
                                               use))
        return self

    def useReplicatedTensorSharding(self, use: bool = True) -> "TensorLocationSettings":
        """Shard weights / optimizer state over replicas (recorded only)."""
        self.createOrSet(useReplicatedTensorSharding=check_bool(
            "TensorLocationSettings.useReplicatedTensorSharding", use))
        return self

    def useIOTilesToLoad(self, use: bool = True) -> "TensorLocationSettings":
        """Load the tensor through IO tiles (recorded only)."""
        self.createOrSet(useIOTilesToLoad=check_bool(
            "TensorLocationSettings.useIOTilesToLoad", use))
        return self

    def useIOTilesToStore(self, use: bool = True) -> "TensorLocationSettings":
        """Store the tensor through IO tiles (recorded only)."""
        self.createOrSet(useIOTilesToStore=check_bool(
            "TensorLocationSettings.useIOTilesToStore", use))
        return self


class _TensorLocationOptions(OptionsDict):
    """Options controlling where tensors are stored.

    >>> opts = poptorch.Options()
    >>> opts.TensorLocations.setActivationLocation(
    ...     poptorch.TensorLocationSettings().useOnChipStorage(False))
    """

    _KINDS = ("activation", "weight", "optimizer", "accumulator")

    def __init__(self) -> None:
        super().__init__(num_io_tiles=0, location_activation={}, location_weight={},
                         location_optimizer={}, location_accumulator={})

    def numIOTiles(self, num_tiles: int) -> "_TensorLocationOptions":
        """Upstream: tiles reserved for IO (an even number >= 32). Recorded only."""
        check_int("TensorLocations.numIOTiles", num_tiles, minimum=32)
        if num_tiles % 2:
            raise Error(f"TensorLocations.numIOTiles: the number of IO tiles must be even, "
                        f"got {num_tiles}.")
        self.set(num_io_tiles=num_tiles)
        return self

    def _set_location(self, kind: str, location: TensorLocationSettings
                      ) -> "_TensorLocationOptions":
        if not isinstance(location, TensorLocationSettings):
            raise Error(f"TensorLocations.set{kind.capitalize()}Location: expected a "
                        f"poptorch.TensorLocationSettings, got {location!r}.")
        self.set(**{f"location_{kind}": location.toDict()})
        return self

    def setActivationLocation(self, location: TensorLocationSettings
                              ) -> "_TensorLocationOptions":
        """Where activations are stored."""
        return self._set_location("activation", location)

    def setWeightLocation(self, location: TensorLocationSettings
                          ) -> "_TensorLocationOptions":
        """Where weights are stored."""
        return self._set_location("weight", location)

    def setOptimizerLocation(self, location: TensorLocationSettings
                             ) -> "_TensorLocationOptions":
        """Where optimizer state is stored."""
        return self._set_location("optimizer", location)

    def setAccumulatorLocation(self, location: TensorLocationSettings
                               ) -> "_TensorLocationOptions":
        """Where gradient accumulators are stored."""
        return self._set_location("accumulator", location)

    def _ignored(self) -> dict[str, Any]:
        ignored = {}
        if self._values["num_io_tiles"]:
            ignored["TensorLocations.num_io_tiles"] = self._values["num_io_tiles"]
        for kind in self._KINDS:
            settings = self._values[f"location_{kind}"]
            for key in _IGNORED_LOCATION_KEYS:
                if key in settings:
                    ignored[f"TensorLocations.location_{kind}.{key}"] = settings[key]
        return ignored


# --------------------------------------------------------------------------------------
# Options-level values with no meaning on our devices, and their "not set" value.
_IGNORED_TOP_LEVEL = ("connection_type", "sync_pattern", "available_memory_proportion",
                      "enable_stable_norm", "log_cycle_count", "module_namescope",
                      "source_location_excludes", "ipu_version")

# Methods that are not setters: config files and JSON cannot call them.
_NOT_SETTERS = frozenset({"loadFromFile", "from_json", "clone", "toDict", "exists",
                          "checkIsFrozen", "defaultOutputMode", "update", "createOrSet",
                          "deleteIfExists"})
_SUB_OBJECTS = ("Training", "Precision", "TensorLocations", "Jit", "Distributed", "_Popart")


class Options(OptionsDict):
    """Set of all options controlling how a model is compiled and executed.

    Pass an instance to :py:func:`poptorch.inferenceModel` or
    :py:func:`poptorch.trainingModel`.

    >>> opts = poptorch.Options()
    >>> opts.deviceIterations(10)
    >>> opts.Training.gradientAccumulation(4)
    """

    def __init__(self) -> None:
        self._popart = _PopartOptions()
        self._training = _TrainingOptions(self._popart)
        self._precision = _PrecisionOptions(self._popart)
        self._tensor_locations = _TensorLocationOptions()
        self._jit = _JitOptions()
        self._distributed = _DistributedOptions()
        self._log_dir_set = False
        super().__init__(
            replication_factor=1,
            input_group_size=1,
            input_cgt=enums.CommGroupType.Consecutive,
            broadcast_buffers=True,
            device_iterations=1,
            log_dir=".",
            auto_round_num_ipus=False,
            anchored_tensors={},
            output_mode=enums.OutputMode.Default.value,
            output_return_period=1,
            connection_type=enums.ConnectionType.Always.value,
            sync_pattern=enums.SyncPattern.Full.value,
            available_memory_proportion={},
            max_repeat_logs=4,
            execution_strategy=None,
            show_compilation_progress_bar=True,
            relax_optimizer_attributes_checks=False,
            enable_stable_norm=False,
            synthetic_data=False,
            log_cycle_count=False,
            module_namescope=True,
            source_location_excludes=list(_DEFAULT_SOURCE_LOCATION_EXCLUDES),
            updatable_named_buffers=None,
            executable_cache_dir=None,
            profile_dir=None,
        )
        cache_dir = os.environ.get("POPTORCH_CACHE_DIR")
        if cache_dir:
            self.enableExecutableCaching(cache_dir)

    # -- sub-objects ---------------------------------------------------------------
    @property
    def Training(self) -> _TrainingOptions:
        """Options specific to training (:py:class:`~poptorch.options._TrainingOptions`)."""
        return self._training

    @property
    def Precision(self) -> _PrecisionOptions:
        """Options related to precision (:py:class:`~poptorch.options._PrecisionOptions`)."""
        return self._precision

    @property
    def TensorLocations(self) -> _TensorLocationOptions:
        """Options related to tensor locations."""
        return self._tensor_locations

    @property
    def Jit(self) -> _JitOptions:
        """Options related to capturing and compiling the model."""
        return self._jit

    @property
    def Distributed(self) -> _DistributedOptions:
        """Options specific to running over several processes."""
        return self._distributed

    @property
    def _Popart(self) -> _PopartOptions:
        """Upstream PopART session options (recorded only)."""
        return self._popart

    def _sub_objects(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in _SUB_OBJECTS}

    # -- batching and replication --------------------------------------------------
    def deviceIterations(self, device_iterations: int) -> "Options":
        """Number of iterations the device runs over the data before returning to the
        user (default: 1)."""
        self.set(device_iterations=check_int("deviceIterations", device_iterations,
                                             minimum=1))
        return self

    def replicationFactor(self, replication_factor: int) -> "Options":
        """Number of times to replicate the model (default: 1)."""
        self.set(replication_factor=check_int("replicationFactor", replication_factor,
                                              minimum=1))
        return self

    def inputReplicaGrouping(self, input_group_size: int,
                             input_group_type: enums.CommGroupType) -> "Options":
        """Split the input batches between groups of ``input_group_size`` replicas
        arranged by ``input_group_type`` (not ``CommGroupType.All``). The group size
        must divide the replication factor; that is checked when the model runs."""
        size = check_int("inputReplicaGrouping input_group_size", input_group_size,
                         minimum=1)
        cgt = check_enum("inputReplicaGrouping input_group_type", input_group_type,
                         enums.CommGroupType,
                         [t for t in enums.CommGroupType if t != enums.CommGroupType.All])
        self.set(input_group_size=size, input_cgt=cgt)
        return self

    def broadcastBuffers(self, broadcast_buffers: bool = True) -> "Options":
        """Keep buffers in sync over replicas (True, default) or per replica (False)."""
        self.set(broadcast_buffers=check_bool("broadcastBuffers", broadcast_buffers))
        return self

    # -- outputs -------------------------------------------------------------------
    def outputMode(self, output_mode: enums.OutputMode,
                   output_return_period: int | None = None) -> "Options":
        """Which outputs come back: ``All``, ``Sum``, ``Final``, ``EveryN`` (every
        ``output_return_period`` device iterations) or ``Default`` (``All`` for
        inference, ``Final`` for training)."""
        mode = check_enum("outputMode", output_mode, enums.OutputMode)
        if mode == enums.OutputMode.EveryN:
            if output_return_period is None:
                raise Error("outputMode: OutputMode.EveryN needs output_return_period, "
                            "e.g. outputMode(OutputMode.EveryN, 10).")
            period = check_int("outputMode output_return_period", output_return_period,
                               minimum=1)
        else:
            if output_return_period is not None:
                raise Error(f"outputMode: output_return_period must only be set when "
                            f"output_mode is OutputMode.EveryN, not {mode.name}.")
            period = 1
        self.set(output_mode=mode.value, output_return_period=period)
        return self

    def anchorMode(self, anchor_mode: enums.OutputMode,
                   anchor_return_period: int | None = None) -> "Options":
        """SDK 2.x name of :py:meth:`outputMode`."""
        return self.outputMode(anchor_mode, anchor_return_period)

    def defaultOutputMode(self) -> bool:
        """True while :py:meth:`outputMode` is still ``OutputMode.Default``."""
        return self._values["output_mode"] == enums.OutputMode.Default.value

    def anchorTensor(self, short_name: str, long_name: str, output_mode=None,
                     output_return_period: int = 1) -> "Options":
        """Make the tensor ``long_name`` retrievable as ``short_name`` after each run.

        Recorded in ``anchored_tensors[short_name]`` as a dict with keys
        ``long_name``, ``output_mode`` (an ``OutputMode`` value, or None to follow the
        model's output mode) and ``output_return_period``.
        """
        check_str("anchorTensor short_name", short_name)
        check_str("anchorTensor long_name", long_name)
        mode = None
        if output_mode is not None:
            mode = check_enum("anchorTensor output_mode", output_mode,
                              enums.OutputMode).value
        period = check_int("anchorTensor output_return_period", output_return_period,
                           minimum=1)
        anchors = dict(self._values["anchored_tensors"])
        anchors[short_name] = {"long_name": long_name, "output_mode": mode,
                               "output_return_period": period}
        self.set(anchored_tensors=anchors)
        return self

    # -- devices -------------------------------------------------------------------
    def autoRoundNumIPUs(self, auto_round_num_ipus: bool = True) -> "Options":
        """Round the number of IPUs used up to a power of two instead of failing."""
        self.set(auto_round_num_ipus=check_bool("autoRoundNumIPUs", auto_round_num_ipus))
        return self

    def useIpuModel(self, use_model: bool) -> "Options":
        """True: virtual IPUs on the CPU. False: demand accelerator hardware (an error
        at compile time if there is none). Takes precedence over
        ``POPTORCH_IPU_MODEL``."""
        self.createOrSet(use_model=check_bool("useIpuModel", use_model))
        return self

    def useIpuId(self, ipu_id: int) -> "Options":
        """Use the accelerator with this id as the first IPU (GPU ``cuda:ipu_id``)."""
        self.createOrSet(ipu_id=check_int("useIpuId", ipu_id, minimum=0))
        return self

    def useOfflineIpuTarget(self, ipu_version: int = 2) -> "Options":
        """Upstream: compile for an absent IPU of this version (1, 2 or 21) without
        running. Recorded only: our devices can always compile and run."""
        version = check_int("useOfflineIpuTarget", ipu_version)
        if version not in (1, 2, 21):
            raise Error(f"useOfflineIpuTarget: ipu_version must be 1, 2 or 21, "
                        f"got {version}.")
        self.createOrSet(ipu_version=version)
        return self

    def connectionType(self, connection_type: enums.ConnectionType) -> "Options":
        """When to attach to the device (recorded only)."""
        self.set(connection_type=check_enum("connectionType", connection_type,
                                            enums.ConnectionType).value)
        return self

    def syncPattern(self, sync_pattern: enums.SyncPattern) -> "Options":
        """Multi-IPU synchronisation pattern (recorded only)."""
        self.set(sync_pattern=check_enum("syncPattern", sync_pattern,
                                         enums.SyncPattern).value)
        return self

    def setAvailableMemoryProportion(self, available_memory_proportion: dict
                                     ) -> "Options":
        """Per-IPU temporary memory proportion, e.g. ``{"IPU0": 0.5}`` (recorded only)."""
        if not isinstance(available_memory_proportion, dict):
            raise Error(f"setAvailableMemoryProportion: expected a dict such as "
                        f"{{'IPU0': 0.5}}, got {available_memory_proportion!r}.")
        for key, value in available_memory_proportion.items():
            if not (isinstance(key, str) and key.startswith("IPU") and key[3:].isdigit()):
                raise Error(f"setAvailableMemoryProportion: keys must look like 'IPU0', "
                            f"got {key!r}.")
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not 0.0 <= value <= 1.0:
                raise Error(f"setAvailableMemoryProportion: values must be numbers in "
                            f"[0, 1], got {key}={value!r}.")
        self.set(available_memory_proportion=dict(available_memory_proportion))
        return self

    # -- execution -----------------------------------------------------------------
    def setExecutionStrategy(self, strategy) -> "Options":
        """Partition the model with this strategy: an instance of
        :py:class:`~poptorch.PipelinedExecution`, :py:class:`~poptorch.ShardedExecution`,
        :py:class:`~poptorch.SerialPhasedExecution` or
        :py:class:`~poptorch.ParallelPhasedExecution`."""
        from .annotations import _IExecutionStrategy  # pylint: disable=import-outside-toplevel
        if not isinstance(strategy, _IExecutionStrategy):
            raise Error(f"setExecutionStrategy: expected an instance of "
                        f"PipelinedExecution, ShardedExecution, SerialPhasedExecution or "
                        f"ParallelPhasedExecution, got {strategy!r}.")
        self.set(execution_strategy=strategy)
        return self

    def randomSeed(self, random_seed: int) -> "Options":
        """Seed the random number generators used by the model. As upstream, this also
        seeds the host's ``torch`` generator (``torch.manual_seed``)."""
        seed = check_int("randomSeed", random_seed, minimum=0, maximum=2**64 - 1)
        torch.manual_seed(seed)
        self.createOrSet(random_seed=seed)
        return self

    def enableSyntheticData(self, enabled: bool) -> "Options":
        """Replace host inputs by random data generated on the device (benchmarking)."""
        self.set(synthetic_data=check_bool("enableSyntheticData", enabled))
        return self

    def enableStableNorm(self, enabled: bool) -> "Options":
        """Upstream: slower, more accurate norm operators. Recorded only: ours are
        always computed the PyTorch way."""
        self.set(enable_stable_norm=check_bool("enableStableNorm", enabled))
        return self

    def updatableNamedBuffers(self, buffers: list[str]) -> "Options":
        """Names of the model buffers that ``buffersFromHost()`` copies to the device."""
        self.set(updatable_named_buffers=_check_str_list("updatableNamedBuffers", buffers))
        return self

    def relaxOptimizerAttributesChecks(self, relax: bool = True) -> "Options":
        """Log unexpected optimizer attributes at DEBUG instead of WARN."""
        self.set(relax_optimizer_attributes_checks=check_bool(
            "relaxOptimizerAttributesChecks", relax))
        return self

    def showCompilationProgressBar(self, show: bool = True) -> "Options":
        """Show a progress bar while the model compiles (default: shown)."""
        self.set(show_compilation_progress_bar=check_bool("showCompilationProgressBar",
                                                          show))
        return self

    def enableExecutableCaching(self, path: str | None) -> "Options":
        """Cache compiled programs in the directory ``path`` (None: no caching).
        ``POPTORCH_CACHE_DIR`` sets it for every new Options object."""
        self.set(executable_cache_dir=_check_optional_path("enableExecutableCaching", path))
        return self

    def enableProfiling(self, profile_dir: str | None = None) -> "Options":
        """Write a profiling trace into ``profile_dir`` (default: current directory)."""
        path = _check_optional_path("enableProfiling", profile_dir)
        self.set(profile_dir=path if path is not None else ".")
        return self

    def modelName(self, name: str) -> "Options":
        """Name of the model (used for profiling report sub-directories)."""
        self.createOrSet(model_name=check_str("modelName", name))
        return self

    # -- logging and debugging ---------------------------------------------------------
    def logDir(self, log_dir: str) -> "Options":
        """Also write PopTorch's log to ``<log_dir>/poptorch.log`` once a model is
        compiled with these options."""
        path = _check_optional_path("logDir", log_dir)
        if path is None:
            raise Error("logDir: expected a directory path, got None.")
        self.set(log_dir=path)
        self._log_dir_set = True
        return self

    def maxRepeatLogs(self, max_lines: int | None) -> "Options":
        """Suppress a log message repeated more than ``max_lines`` times in a row
        (None: never suppress; default 4)."""
        if max_lines is not None:
            check_int("maxRepeatLogs", max_lines, minimum=1)
        self.set(max_repeat_logs=max_lines)
        return self

    def logCycleCount(self, log_cycle_count: bool) -> "Options":
        """Upstream: log IPU cycle counts. Recorded only (no cycle counter here)."""
        self.set(log_cycle_count=check_bool("logCycleCount", log_cycle_count))
        return self

    def disableModuleNamescope(self) -> "Options":
        """Upstream: do not prefix op names with module names. Recorded only."""
        self.set(module_namescope=False)
        return self

    def sourceLocationExcludes(self, excludes: list[str]) -> "Options":
        """Frames to skip when attributing IR to source lines (recorded only)."""
        self.set(source_location_excludes=_check_str_list("sourceLocationExcludes",
                                                          excludes))
        return self

    def appendToLocationExcludes(self, *excludes: str) -> "Options":
        """Add frames to skip when attributing IR to source lines (recorded only)."""
        added = _check_str_list("appendToLocationExcludes", list(excludes))
        self.set(source_location_excludes=self._values["source_location_excludes"] + added)
        return self

    # -- whole-object operations ---------------------------------------------------------
    def toDict(self) -> dict[str, Any]:
        """All option values, with the sub-objects' values nested under their names."""
        out = super().toDict()
        for name, sub in self._sub_objects().items():
            out[name] = sub.toDict()
        return out

    def clone(self) -> "Options":
        """An unfrozen deep copy of these options."""
        clone = copy.deepcopy(self)
        object.__setattr__(clone, "_frozen", False)
        for sub in clone._sub_objects().values():
            if isinstance(sub, _PopartOptions):
                sub._unfreeze()
            else:
                object.__setattr__(sub, "_frozen", False)
        return clone

    def _freeze(self) -> None:
        """Forbid changes (a model is compiled with these options); apply the logging
        options and log, once, every option that has no meaning on our devices."""
        super()._freeze()
        for sub in self._sub_objects().values():
            sub._freeze()
        _logging.apply_options(self)
        for name, value in self._ignored_options().items():
            _logging.info_once(("ignored option", name, repr(value)),
                               "Option %s=%r has no meaning on this device and is ignored "
                               "(see docs/options.md).", name, value)

    def _ignored_options(self) -> dict[str, Any]:
        """``{name: value}`` of the options set that have no meaning on our devices."""
        ignored = {name: self._values[name] for name in _IGNORED_TOP_LEVEL
                   if self._changed_from_default(name)}
        for sub in self._sub_objects().values():
            ignored.update(sub._ignored())
        return ignored

    def __repr__(self) -> str:
        own = ", ".join(f"{k}={v!r}" for k, v in sorted(self._values.items()))
        subs = ", ".join(f"{name}={sub!r}" for name, sub in self._sub_objects().items())
        return f"Options({own}, {subs})"

    # -- loading -------------------------------------------------------------------------
    def _resolve_setter(self, path: list[str]) -> Callable:
        """The setter method at ``path`` (e.g. ``["Training", "gradientAccumulation"]``)."""
        target: Any = self
        for part in path[:-1]:
            if part not in _SUB_OBJECTS:
                raise Error(f"'{part}' is not an options category; use one of "
                            f"{', '.join(_SUB_OBJECTS)}.")
            target = getattr(target, part)
        name = path[-1]
        if name.startswith("_") or name in _NOT_SETTERS or (
                name == "set" and isinstance(target, OptionsDict)):
            raise Error(f"'{'.'.join(path)}' is not an option setter.")
        if name == "backend" and isinstance(target, _JitOptions):
            return target._set_backend
        method = getattr(type(target), name, None)
        if not callable(method) or isinstance(method, property):
            raise Error(f"Unknown option setter '{'.'.join(path)}'.")
        return getattr(target, name)

    def loadFromFile(self, filepath: str) -> "Options":
        """Apply a config file: one setter call per line, written as in Python without
        the ``options.`` prefix (``deviceIterations(4)``,
        ``Training.gradientAccumulation(2)``); ``#`` starts a comment.

        Arguments may be literals, enum members (``poptorch.OutputMode.All``) and
        ``torch`` dtypes. A line that cannot be applied raises
        :py:class:`poptorch.ConfigFileError` naming the file and line.
        """
        with open(filepath, encoding="utf-8") as handle:
            lines = handle.read().splitlines()
        for lineno, line in enumerate(lines, start=1):
            text = line.strip()
            if not text or text.startswith("#"):
                continue
            try:
                self._apply_command(text)
            except (Error, ValueError, TypeError, SyntaxError, AttributeError) as exc:
                reason = exc.message if isinstance(exc, Error) else str(exc)
                raise ConfigFileError(f"{filepath}:{lineno}: cannot apply {text!r}: "
                                      f"{reason}") from exc
        return self

    def _apply_command(self, text: str) -> None:
        try:
            tree = ast.parse(text, mode="eval")
        except SyntaxError as exc:
            raise Error(f"not a valid Python expression ({exc.msg}).") from None
        call = tree.body
        if not isinstance(call, ast.Call):
            raise Error("expected a setter call such as deviceIterations(4).")
        path = _dotted_name(call.func)
        if path is None:
            raise Error("expected a setter call such as deviceIterations(4).")
        if path[0] in ("options", "opts") and len(path) > 1:
            path = path[1:]
        setter = self._resolve_setter(path)
        args = [_safe_value(arg) for arg in call.args]
        kwargs = {}
        for keyword in call.keywords:
            if keyword.arg is None:
                raise Error("**kwargs are not supported in config files.")
            kwargs[keyword.arg] = _safe_value(keyword.value)
        setter(*args, **kwargs)

    def from_json(self, string: str) -> "Options":
        """Apply options from a JSON object ``{"name.of.setter": value}``; a list value
        is passed as positional arguments::

            Options().from_json('{"Precision.enableFloatingPointExceptions": true}')
            Options().from_json('{"_Popart.set": ["OptionName", 1]}')
        """
        try:
            values = json.loads(string)
        except json.JSONDecodeError as exc:
            raise Error(f"from_json: invalid JSON ({exc}).") from None
        if not isinstance(values, dict):
            raise Error("from_json: expected a JSON object {\"name.of.setter\": value}.")
        for key, value in values.items():
            try:
                setter = self._resolve_setter(key.split("."))
            except Error as exc:
                raise Error(f"from_json: {exc.message}") from None
            if isinstance(value, list):
                setter(*value)
            else:
                setter(value)
        return self


# -- safe evaluation of config-file arguments ---------------------------------------------
def _dotted_name(node: ast.AST) -> list[str] | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(node.id)
    return parts[::-1]


def _resolve_constant(path: list[str]) -> Any:
    """An enum member, enum class, torch dtype or TensorLocationSettings named by path."""
    if path[0] == "poptorch":
        path = path[1:]
        if path and path[0] == "enums":
            path = path[1:]
    if path and path[0] == "torch" and len(path) == 2:
        value = getattr(torch, path[1], None)
        if isinstance(value, torch.dtype):
            return value
        raise ValueError(f"torch.{path[1]} is not a torch dtype.")
    if path == ["TensorLocationSettings"]:
        return TensorLocationSettings
    if len(path) == 2 and path[0] in enums.__all__:
        enum_type = getattr(enums, path[0])
        if path[1] in enum_type.__members__:
            return enum_type[path[1]]
    raise ValueError(f"unknown name {'.'.join(path)!r} (config files may use literals, "
                     f"enum members such as poptorch.OutputMode.All, torch dtypes and "
                     f"poptorch.TensorLocationSettings()).")


def _safe_value(node: ast.AST) -> Any:
    """Evaluate a config-file argument without ``eval``."""
    try:
        return ast.literal_eval(node)
    except ValueError:
        pass
    if isinstance(node, (ast.Attribute, ast.Name)):
        path = _dotted_name(node)
        if path is not None:
            return _resolve_constant(path)
    if isinstance(node, ast.List):
        return [_safe_value(e) for e in node.elts]
    if isinstance(node, ast.Tuple):
        return tuple(_safe_value(e) for e in node.elts)
    if isinstance(node, ast.Dict) and None not in node.keys:
        return {_safe_value(k): _safe_value(v) for k, v in zip(node.keys, node.values)}
    if isinstance(node, ast.Call) and not node.keywords:
        func_path = _dotted_name(node.func)
        if func_path is not None and _resolve_constant(func_path) is TensorLocationSettings:
            if node.args:
                raise ValueError("TensorLocationSettings() takes no arguments here.")
            return TensorLocationSettings()
        if isinstance(node.func, ast.Attribute):
            receiver = _safe_value(node.func.value)
            name = node.func.attr
            if isinstance(receiver, TensorLocationSettings) and not name.startswith("_") \
                    and hasattr(TensorLocationSettings, name) \
                    and name not in dir(OptionsDict):
                return getattr(receiver, name)(*[_safe_value(a) for a in node.args])
    raise ValueError(f"unsupported expression {ast.unparse(node)!r}.")


# --------------------------------------------------------------------------------------
_attribute_stack: list[dict[str, Any]] = []


class Attribute:
    """Context manager attaching PopART-style attributes to the ops created inside it::

        with poptorch.Attribute(__outline={"layer": "embedding"}):
            ...

    PopART attributes have no meaning on our devices: they are recorded (see
    :py:func:`current_attributes`) and reported once at INFO.
    """

    def __init__(self, **kwargs: Any) -> None:
        self.attributes = kwargs

    def __enter__(self) -> "Attribute":
        _logging.info_once(("Attribute", tuple(sorted(self.attributes))),
                           "poptorch.Attribute(%s) is recorded only: PopART attributes "
                           "have no meaning on this device.",
                           ", ".join(sorted(self.attributes)))
        _attribute_stack.append(self.attributes)
        return self

    def __exit__(self, type, value, traceback) -> None:  # pylint: disable=redefined-builtin
        _attribute_stack.pop()


def current_attributes() -> dict[str, Any]:
    """The attributes of the enclosing ``poptorch.Attribute`` blocks (inner wins)."""
    merged: dict[str, Any] = {}
    for attributes in _attribute_stack:
        merged.update(attributes)
    return merged



# Upstream defines the execution strategies in this module; programs import them from
# here too (``poptorch.options.PipelinedExecution``), so re-export the same objects.
from .annotations import (ParallelPhasedExecution, Phase,  # noqa: E402  pylint: disable=wrong-import-position
                          PipelinedExecution, SerialPhasedExecution, ShardedExecution, Stage)
