"""``poptorch.Options``: every option controlling how a model is compiled and run.

Options objects are configuration only: setters validate their arguments and record
them; the executor and the runtime read the recorded values (see docs/options.md for
which module applies each option, and for the options that have no meaning on our
devices). Setters return the object they belong to, so calls chain::

    opts = poptorch.Options().deviceIterations(4).replicationFactor(2)
    opts.Training.gradientAccumulation(8)
"""
from __future__ import annotations

import copy
import json
import numbers
import os
from typing import ClassVar, cast

import torch

from .. import _devices, _logging, enums
from .._typing import OptionValue
from ..annotations.strategies import PipelinedExecution, _IExecutionStrategy, _IPhasedExecution
from ..errors import ConfigFileError, Error
from .config_file import SUB_OBJECTS, apply_command, resolve_setter
from .distributed import _DistributedOptions
from .jit import _JitOptions
from .popart import _PopartOptions
from .precision import _PrecisionOptions
from .store import (
    OptionChoiceError,
    OptionsDict,
    OptionValueError,
    check_bool,
    check_enum,
    check_int,
    check_optional_path,
    check_str,
    check_str_list,
    check_truth,
)
from .tensor_locations import _TensorLocationOptions
from .training import _TrainingOptions

__all__ = ["Options"]

_DEFAULT_SOURCE_LOCATION_EXCLUDES = ["install/poptorch", "site-packages/torch",
                                     "site-packages/poptorch"]

# Options-level values with no meaning on our devices (but connection_type Never).
_IGNORED_TOP_LEVEL = ("connection_type", "sync_pattern", "available_memory_proportion",
                      "enable_stable_norm", "log_cycle_count", "module_namescope",
                      "source_location_excludes", "ipu_version")

_SYNTHETIC_RANDOM_NORMAL = 2
"""PopART's ``SyntheticDataMode.RandomNormal`` (0: off, 1: zeros)."""

_OWN_OPTION_DEFAULTS = {
    "execution_strategy": None, "show_compilation_progress_bar": True,
    "relax_optimizer_attributes_checks": False, "enable_stable_norm": False,
    "synthetic_data": False, "log_cycle_count": False, "module_namescope": True,
    "updatable_named_buffers": None, "executable_cache_dir": None, "profile_dir": None,
}
"""Our options that upstream's ``Options.toDict()`` does not list, with their defaults:
``toDict()`` leaves them out while they are at these values."""


class Options(OptionsDict):
    """Set of all options controlling how a model is compiled and executed.

    Pass an instance to :py:func:`poptorch.inferenceModel` or
    :py:func:`poptorch.trainingModel`.

    >>> opts = poptorch.Options()
    >>> opts.deviceIterations(10)
    >>> opts.Training.gradientAccumulation(4)
    """

    _ASSIGNMENT_SETTERS: ClassVar[dict[str, str]] = {
        "device_iterations": "deviceIterations",
        "replication_factor": "replicationFactor",
        "broadcast_buffers": "broadcastBuffers",
        "auto_round_num_ipus": "autoRoundNumIPUs",
        "random_seed": "randomSeed",
        "synthetic_data": "enableSyntheticData",
        "enable_stable_norm": "enableStableNorm",
        "relax_optimizer_attributes_checks": "relaxOptimizerAttributesChecks",
        "show_compilation_progress_bar": "showCompilationProgressBar",
        "log_cycle_count": "logCycleCount",
        "max_repeat_logs": "maxRepeatLogs",
        "model_name": "modelName",
    }

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
        defaults = os.environ.get("POPTORCH_DEFAULT_OPTIONS")
        if defaults:
            # As in PopTorch: every new Options object starts from these (JSON, as
            # from_json takes it).
            try:
                self.from_json(defaults)
            except Error as exc:
                raise Error(f"POPTORCH_DEFAULT_OPTIONS: {exc.message}") from None

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

    def _sub_objects(self) -> dict[str, OptionsDict]:
        return {name: getattr(self, name) for name in SUB_OBJECTS}

    # -- batching and replication --------------------------------------------------
    def deviceIterations(self, device_iterations: int) -> Options:
        """Number of iterations the device runs over the data before returning to the
        user (default: 1)."""
        self.set(device_iterations=check_int("deviceIterations", device_iterations,
                                             minimum=1))
        return self

    def replicationFactor(self, replication_factor: int) -> Options:
        """Number of times to replicate the model (default: 1)."""
        self.set(replication_factor=check_int("replicationFactor", replication_factor,
                                              minimum=1))
        return self

    def inputReplicaGrouping(self, input_group_size: int,
                             input_group_type: enums.CommGroupType) -> Options:
        """Split the input batches between groups of ``input_group_size`` replicas
        arranged by ``input_group_type`` (not ``CommGroupType.All``;
        ``CommGroupType.NoGrouping`` means groups of one replica, as upstream). The
        group size must divide the replication factor; that is checked when the model
        runs."""
        cgt = check_enum("inputReplicaGrouping input_group_type", input_group_type,
                         enums.CommGroupType)
        if cgt == enums.CommGroupType.All:
            raise OptionChoiceError("inputReplicaGrouping: input_group_type cannot be "
                                    "CommGroupType.All; use CommGroupType.Consecutive, "
                                    "CommGroupType.Orthogonal or CommGroupType.NoGrouping.")
        if cgt == enums.CommGroupType.NoGrouping:
            size, cgt = 1, enums.CommGroupType.Consecutive
        else:
            size = check_int("inputReplicaGrouping input_group_size", input_group_size,
                             minimum=1)
        self.set(input_group_size=size, input_cgt=cgt)
        return self

    def broadcastBuffers(self, broadcast_buffers: bool = True) -> Options:
        """Keep buffers in sync over replicas (True, default) or per replica (False)."""
        self.set(broadcast_buffers=check_bool("broadcastBuffers", broadcast_buffers))
        return self

    # -- outputs -------------------------------------------------------------------
    def outputMode(self, output_mode: enums.OutputMode,
                   output_return_period: int | None = None) -> Options:
        """Which outputs come back: ``All``, ``Sum``, ``Final``, ``EveryN`` (every
        ``output_return_period`` device iterations) or ``Default`` (``All`` for
        inference, ``Final`` for training)."""
        mode = check_enum("outputMode", output_mode, enums.OutputMode)
        if mode == enums.OutputMode.EveryN:
            if output_return_period is None:
                raise OptionValueError("outputMode: OutputMode.EveryN needs "
                                       "output_return_period, e.g. "
                                       "outputMode(OutputMode.EveryN, 10).")
            period = check_int("outputMode output_return_period", output_return_period,
                               minimum=1)
        else:
            # As in PopTorch: a period given with another mode is accepted and unused.
            if output_return_period:
                _logging.info_once(("outputMode period", mode.name),
                                   "outputMode: output_return_period is ignored with "
                                   "OutputMode.%s (it only applies to EveryN).", mode.name)
            period = 1
        self.set(output_mode=mode.value, output_return_period=period)
        return self

    def anchorMode(self, anchor_mode: enums.OutputMode,
                   anchor_return_period: int | None = None) -> Options:
        """SDK 2.x name of :py:meth:`outputMode`."""
        return self.outputMode(anchor_mode, anchor_return_period)

    def defaultOutputMode(self) -> bool:
        """True while :py:meth:`outputMode` is still ``OutputMode.Default``."""
        return self._values["output_mode"] == enums.OutputMode.Default.value

    def anchorTensor(self, short_name: str, long_name: str,
                     output_mode: enums.OutputMode | str | int | None = None,
                     output_return_period: int = 1) -> Options:
        """Make the tensor ``long_name`` retrievable as ``short_name`` after each run.

        Recorded in ``anchored_tensors[short_name]`` as a dict with keys
        ``long_name``, ``output_mode`` (an ``OutputMode`` value, or None to follow the
        model's output mode) and ``output_return_period`` (1 unless the mode is
        ``EveryN``).
        """
        check_str("anchorTensor short_name", short_name)
        check_str("anchorTensor long_name", long_name)
        mode = None
        if output_mode is not None:
            mode = check_enum("anchorTensor output_mode", output_mode,
                              enums.OutputMode).value
        period = 1  # as upstream: the period only counts with OutputMode.EveryN
        if mode == enums.OutputMode.EveryN.value:
            period = check_int("anchorTensor output_return_period", output_return_period,
                               minimum=1)
        anchors = dict(self._values["anchored_tensors"])
        anchors[short_name] = {"long_name": long_name, "output_mode": mode,
                               "output_return_period": period}
        self.set(anchored_tensors=anchors)
        return self

    # -- devices -------------------------------------------------------------------
    def autoRoundNumIPUs(self, auto_round_num_ipus: bool = True) -> Options:
        """Round the number of IPUs used up to a power of two instead of failing."""
        self.set(auto_round_num_ipus=check_bool("autoRoundNumIPUs", auto_round_num_ipus))
        return self

    def useIpuModel(self, use_model: bool) -> Options:
        """True: virtual IPUs on the CPU. False: demand accelerator hardware (an error
        at compile time if there is none). Takes precedence over
        ``POPTORCH_IPU_MODEL``."""
        self.createOrSet(use_model=check_bool("useIpuModel", use_model))
        return self

    def useIpuId(self, ipu_id: int) -> Options:
        """Use the accelerator with this id as the first IPU (GPU ``cuda:ipu_id``)."""
        self.createOrSet(ipu_id=check_int("useIpuId", ipu_id, minimum=0))
        return self

    def useOfflineIpuTarget(self, ipu_version: int = 2) -> Options:
        """Compile for an absent IPU of this version (1, 2 or 21), not run: as upstream,
        ``connectionType(ConnectionType.Never)`` (``poptorch.load`` of its file runs)."""
        version = check_int("useOfflineIpuTarget", ipu_version)
        # Programs write useOfflineIpuTarget(poptorch.ipuHardwareVersion()): whatever
        # that returns on this machine is a valid target too.
        if version not in (1, 2, 21, _devices.ipuHardwareVersion()):
            raise OptionValueError(f"useOfflineIpuTarget: ipu_version must be 1, 2, 21 or this "
                        f"machine's poptorch.ipuHardwareVersion() "
                        f"({_devices.ipuHardwareVersion()}), got {version}.")
        self.connectionType(enums.ConnectionType.Never)
        self.createOrSet(ipu_version=version)
        return self

    def connectionType(self, connection_type: enums.ConnectionType) -> Options:
        """When to attach to the device: ``Never`` compiles but does not run (as
        upstream); the others are recorded only."""
        self.set(connection_type=check_enum("connectionType", connection_type,
                                            enums.ConnectionType).value)
        return self

    def syncPattern(self, sync_pattern: enums.SyncPattern) -> Options:
        """Multi-IPU synchronisation pattern (recorded only)."""
        self.set(sync_pattern=check_enum("syncPattern", sync_pattern,
                                         enums.SyncPattern).value)
        return self

    def setAvailableMemoryProportion(self, available_memory_proportion: dict
                                     ) -> Options:
        """Per-IPU temporary memory proportion, e.g. ``{"IPU0": 0.5}`` (recorded only).
        Values are real numbers in [0, 1] (numpy scalars included)."""
        if not isinstance(available_memory_proportion, dict):
            raise OptionValueError(f"setAvailableMemoryProportion: expected a dict such "
                                   f"as {{'IPU0': 0.5}}, got "
                                   f"{available_memory_proportion!r}.")
        proportions = {}
        for key, value in available_memory_proportion.items():
            if not (isinstance(key, str) and key.startswith("IPU")):
                raise OptionValueError(f"setAvailableMemoryProportion: keys must look "
                                       f"like 'IPU0', got {key!r}.")
            if not key[3:].isdigit():
                raise OptionChoiceError(f"setAvailableMemoryProportion: keys must be "
                                        f"'IPU' and an IPU index, like 'IPU0'; got {key!r}.")
            if isinstance(value, bool) or not isinstance(value, numbers.Real) \
                    or not 0.0 <= float(value) <= 1.0:
                raise OptionValueError(f"setAvailableMemoryProportion: values must be "
                                       f"numbers in [0, 1], got {key}={value!r}.")
            proportions[key] = value if type(value) in (int, float) else float(value)
        self.set(available_memory_proportion=proportions)
        return self

    # -- execution -----------------------------------------------------------------
    def setExecutionStrategy(self, strategy: _IExecutionStrategy) -> Options:
        """Partition the model with this strategy: an instance of
        :py:class:`~poptorch.PipelinedExecution`, :py:class:`~poptorch.ShardedExecution`,
        :py:class:`~poptorch.SerialPhasedExecution` or
        :py:class:`~poptorch.ParallelPhasedExecution`."""
        if not isinstance(strategy, _IExecutionStrategy):
            raise OptionValueError(f"setExecutionStrategy: expected an instance of "
                        f"PipelinedExecution, ShardedExecution, SerialPhasedExecution or "
                        f"ParallelPhasedExecution, got {strategy!r}.")
        if isinstance(strategy, _IPhasedExecution) and not strategy.phases:
            # upstream: an assert in the setter (phases are never automatic)
            raise OptionValueError(f"setExecutionStrategy: {type(strategy).__name__} needs "
                                   "its phases: pass them explicitly, e.g. "
                                   f"{type(strategy).__name__}(poptorch.Phase('0'), "
                                   "poptorch.Phase('1')) for blocks '0' and '1'.")
        self.set(execution_strategy=strategy)
        return self

    @property
    def _execution_strategy(self) -> _IExecutionStrategy:
        """The strategy in force: the one given to :py:meth:`setExecutionStrategy`, else
        the default ``PipelinedExecution(AutoStage.SameAsIpu)`` (made once per object)."""
        strategy = self.execution_strategy
        if strategy is None:
            strategy = self.__dict__.get("_default_strategy")
            if strategy is None:
                strategy = PipelinedExecution()
                object.__setattr__(self, "_default_strategy", strategy)
        return strategy

    def randomSeed(self, random_seed: int) -> Options:
        """Seed the random number generators used by the model. As upstream, this also
        seeds the host's ``torch`` generator (``torch.manual_seed``)."""
        seed = check_int("randomSeed", random_seed, minimum=0)
        if seed > 2**64 - 1:  # upstream: torch.manual_seed's ValueError
            raise OptionChoiceError(f"randomSeed: must be <= 2**64 - 1, got {seed}.")
        torch.manual_seed(seed)
        self.createOrSet(random_seed=seed)
        return self

    def enableSyntheticData(self, enabled: bool) -> Options:
        """Run on data generated on the device instead of the host inputs (to measure
        compute without IO). Any true value (``True``, or PopART's
        ``int(popart.SyntheticDataMode.RandomNormal)`` = 2, as upstream reads it)
        selects random normal data; a false one turns synthetic data off. For zeros,
        set PopART's mode directly: ``opts._Popart.set("syntheticDataMode", 1)``."""
        on = check_truth("enableSyntheticData", enabled)
        self.set(synthetic_data=on)
        self._popart.set("syntheticDataMode", _SYNTHETIC_RANDOM_NORMAL if on else 0)
        return self

    def _synthetic_data_mode(self) -> int:
        """PopART's ``SyntheticDataMode`` in force: 0 off, 1 zeros, 2 random normal
        (``enableSyntheticData`` and ``_Popart.set("syntheticDataMode", n)`` both set
        it; the later call wins)."""
        default = _SYNTHETIC_RANDOM_NORMAL if self._values["synthetic_data"] else 0
        return int(self._popart.options.get("syntheticDataMode", default))

    def enableStableNorm(self, enabled: bool) -> Options:
        """Upstream: slower, more accurate norm operators. Recorded only: ours are
        always computed the PyTorch way."""
        self.set(enable_stable_norm=check_bool("enableStableNorm", enabled))
        return self

    def updatableNamedBuffers(self, buffers: list[str]) -> Options:
        """Names of the model buffers that ``buffersFromHost()`` copies to the device
        (a list, tuple or set of names)."""
        self.set(updatable_named_buffers=check_str_list("updatableNamedBuffers", buffers))
        return self

    def relaxOptimizerAttributesChecks(self, relax: bool = True) -> Options:
        """Log unexpected optimizer attributes at DEBUG instead of WARN (read as a
        truth value, as upstream)."""
        self.set(relax_optimizer_attributes_checks=check_truth(
            "relaxOptimizerAttributesChecks", relax))
        return self

    def showCompilationProgressBar(self, show: bool = True) -> Options:
        """Show a progress bar while the model compiles (default: shown; read as a
        truth value, as upstream)."""
        self.set(show_compilation_progress_bar=check_truth("showCompilationProgressBar",
                                                           show))
        return self

    def enableExecutableCaching(self, path: str | None) -> Options:
        """Cache compiled programs in the directory ``path`` (None: no caching).
        ``POPTORCH_CACHE_DIR`` sets it for every new Options object."""
        self.set(executable_cache_dir=check_optional_path("enableExecutableCaching", path))
        return self

    def enableProfiling(self, profile_dir: str | None = None) -> Options:
        """Write a profiling trace into ``profile_dir`` (default: current directory)."""
        path = check_optional_path("enableProfiling", profile_dir)
        self.set(profile_dir=path if path is not None else ".")
        return self

    def modelName(self, name: str) -> Options:
        """Name of the model (used for profiling report sub-directories)."""
        self.createOrSet(model_name=check_str("modelName", name))
        return self

    # -- logging and debugging ---------------------------------------------------------
    def logDir(self, log_dir: str) -> Options:
        """Also write PopTorch's log to ``<log_dir>/poptorch.log`` once a model is
        compiled with these options."""
        path = check_optional_path("logDir", log_dir)
        if path is None:
            raise OptionValueError("logDir: expected a directory path, got None.")
        self.set(log_dir=path)
        self._log_dir_set = True
        return self

    def maxRepeatLogs(self, max_lines: int | None) -> Options:
        """Suppress a log message repeated more than ``max_lines`` times in a row
        (None: never suppress; 0: show each message once and suppress its repeats;
        default 4)."""
        if max_lines is not None:
            check_int("maxRepeatLogs", max_lines, minimum=0)
        self.set(max_repeat_logs=max_lines)
        return self

    def logCycleCount(self, log_cycle_count: bool) -> Options:
        """Upstream: log IPU cycle counts. Recorded only (no cycle counter here)."""
        self.set(log_cycle_count=check_bool("logCycleCount", log_cycle_count))
        return self

    def disableModuleNamescope(self) -> Options:
        """Upstream: do not prefix op names with module names. Recorded only."""
        self.set(module_namescope=False)
        return self

    def sourceLocationExcludes(self, excludes: list[str]) -> Options:
        """Frames to skip when attributing IR to source lines (recorded only)."""
        self.set(source_location_excludes=check_str_list("sourceLocationExcludes",
                                                          excludes))
        return self

    def appendToLocationExcludes(self, *excludes: str) -> Options:
        """Add frames to skip when attributing IR to source lines (recorded only)."""
        added = check_str_list("appendToLocationExcludes", list(excludes))
        self.set(source_location_excludes=self._values["source_location_excludes"] + added)
        return self

    # -- whole-object operations ---------------------------------------------------------
    def toDict(self) -> dict[str, OptionValue]:
        """All option values, with the sub-objects' values nested under their names.

        Our own options (names upstream's ``toDict`` does not have, such as
        ``executable_cache_dir``) are listed only once set to something other than their
        default, so that code comparing the dictionary with its own configuration
        (optimum-graphcore's IPUConfig) meets only upstream's keys by default."""
        out = super().toDict()
        for name, default in _OWN_OPTION_DEFAULTS.items():
            if name in out and out[name] == default:
                del out[name]
        for name, sub in self._sub_objects().items():
            out[name] = sub.toDict()
        return out

    def clone(self) -> Options:
        """An unfrozen deep copy of these options."""
        return copy.deepcopy(self)

    def __deepcopy__(self, memo: dict) -> Options:
        # A copy is for changing (upstream: copies of frozen options are unfrozen).
        clone = cast("Options", super().__deepcopy__(memo))
        object.__setattr__(clone, "_frozen", False)
        for sub in clone._sub_objects().values():
            if isinstance(sub, _PopartOptions):
                sub._unfreeze()
            else:
                object.__setattr__(sub, "_frozen", False)
        return clone

    def _freeze(self) -> None:
        """Forbid changes (a model is wrapped or compiled with these options, or a
        DataLoader read its batching from them). Nothing else: the options take
        effect when a model compiles (:py:meth:`_apply_effects`)."""
        super()._freeze()
        for sub in self._sub_objects().values():
            sub._freeze()

    def _apply_effects(self) -> None:
        """What these options do beyond configuring the compiled program, done when a
        model compiles with them: apply the logging options (``logDir``,
        ``maxRepeatLogs``) and log, once, every option that has no meaning on our
        devices."""
        _logging.apply_options(self)
        from .ipu_only import ipu_meaning
        for name, value in self._ignored_options().items():
            _logging.info_once(("ignored option", name, repr(value)),
                               "Option %s=%r: on an IPU it %s; on this device it has no "
                               "effect and is ignored (see docs/options.md).", name, value,
                               ipu_meaning(name))

    def _ignored_options(self) -> dict[str, OptionValue]:
        """``{name: value}`` of the options set that have no meaning on our devices."""
        ignored = {name: self._values[name] for name in _IGNORED_TOP_LEVEL
                   if self._changed_from_default(name)}
        if ignored.get("connection_type") == enums.ConnectionType.Never.value:
            del ignored["connection_type"]
        for sub in self._sub_objects().values():
            ignored.update(sub._ignored())
        return ignored

    def __repr__(self) -> str:
        own = ", ".join(f"{k}={v!r}" for k, v in sorted(self._values.items()))
        subs = ", ".join(f"{name}={sub!r}" for name, sub in self._sub_objects().items())
        return f"Options({own}, {subs})"

    # -- loading -------------------------------------------------------------------------
    def loadFromFile(self, filepath: str) -> Options:
        """Apply a config file: one setter call per line, written as in Python without
        the ``options.`` prefix (``deviceIterations(4)``,
        ``Training.gradientAccumulation(2)``); ``#`` starts a comment.

        Arguments may be literals, enum members (``poptorch.OutputMode.All``) and
        ``torch`` dtypes. A line that cannot be applied raises
        :py:class:`poptorch.ConfigFileError` naming the file and line.
        """
        with open(filepath, encoding="utf-8") as handle:
            lines = handle.read().split("\n")  # \n only: a form feed is no line break
        for lineno, line in enumerate(lines, start=1):
            text = line.strip()
            if not text or text.startswith("#"):
                continue
            try:
                apply_command(self, text)
            except (Error, ValueError, TypeError, SyntaxError, AttributeError) as exc:
                reason = exc.message if isinstance(exc, Error) else str(exc)
                raise ConfigFileError(f"{filepath}:{lineno}: cannot apply {text!r}: "
                                      f"{reason}") from exc
        return self

    def from_json(self, string: str) -> Options:
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
                setter = resolve_setter(self, key.split("."))
            except Error as exc:
                raise Error(f"from_json: {exc.message}") from None
            if isinstance(value, list):
                setter(*value)
            else:
                setter(value)
        return self
