"""The options as the engine reads them: a frozen, typed configuration made once, when a
model compiles (``RuntimeConfig.of``), from the user's ``poptorch.Options``.

The PopTorch setter façade (``options/``) stays the user's interface; the device loop,
the loss scaler, the anchors, the profiler, the precision policy and casting, the tensor
locations and the joining of other processes read this snapshot instead, so a later
change of an options object (a clone, another model's) can never reach a compiled
program, and each engine module states exactly what it reads.
"""
from __future__ import annotations

import types
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from .._typing import OptionsView, OptionValue
from ..enums import (
    CommGroupType,
    HalfFloatCastingBehavior,
    MeanReductionStrategy,
    OutputMode,
    ReductionType,
)
from .placement.strategy import ExecutionStrategy, is_phased

__all__ = ["DistributedConfig", "LocationsConfig", "PlacementConfig", "PrecisionConfig",
           "RuntimeConfig", "TrainingConfig"]


def _frozen(mapping: Mapping[str, OptionValue]) -> Mapping[str, OptionValue]:
    return types.MappingProxyType(dict(mapping or {}))


@dataclass(frozen=True)
class TrainingConfig:
    """``Options.Training`` as the training step reads it."""
    gradient_accumulation: int
    reduction: ReductionType
    mean_strategy: MeanReductionStrategy
    automatic_loss_scaling: bool


@dataclass(frozen=True)
class PrecisionConfig:
    """``Options.Precision`` as the precision policy and the casting rules read it."""
    half_float_casting: HalfFloatCastingBehavior
    partials_type: torch.dtype  # torch.float32 or torch.float16
    stochastic_rounding: bool
    floating_point_exceptions: bool
    running_statistics_always_float: bool
    autocast_enabled: bool
    autocast_policy: object  # a poptorch.autocasting.Policy, or None for the default

    @classmethod
    def of(cls, precision: OptionsView) -> PrecisionConfig:
        """The configuration of ``Options.Precision``."""
        return cls(
            half_float_casting=HalfFloatCastingBehavior(precision.half_float_casting),
            partials_type=precision.partials_type,
            stochastic_rounding=bool(precision.stochastic_rounding),
            floating_point_exceptions=bool(precision.floating_point_exceptions),
            running_statistics_always_float=bool(
                precision.running_statistics_always_float),
            autocast_enabled=bool(getattr(precision, "autocast_enabled", True)),
            autocast_policy=getattr(precision, "autocast_policy", None))


@dataclass(frozen=True)
class LocationsConfig:
    """``Options.TensorLocations`` (``TensorLocationSettings.toDict()`` per kind of
    tensor) as ``_runtime/memory/locations.py`` reads it."""
    activation: Mapping[str, OptionValue]
    weight: Mapping[str, OptionValue]
    optimizer: Mapping[str, OptionValue]
    accumulator: Mapping[str, OptionValue]
    num_io_tiles: int
    phased: bool  # the execution strategy is phased (which places tensors itself)

    @classmethod
    def of(cls, options: OptionsView) -> LocationsConfig:
        """The configuration of ``options.TensorLocations``."""
        locations = options.TensorLocations
        return cls(**{kind: _frozen(getattr(locations, f"location_{kind}", {}))
                      for kind in ("activation", "weight", "optimizer", "accumulator")},
                   num_io_tiles=int(locations.num_io_tiles),
                   phased=is_phased(options._execution_strategy))


@dataclass(frozen=True)
class DistributedConfig:
    """What joining the other processes of a run reads (``Options.Distributed`` and
    the options every process must agree on)."""
    process_id: int
    num_processes: int
    broadcast_buffers: bool
    input_group_size: int
    input_cgt: CommGroupType
    strategy_name: str | None  # the class of the execution strategy set, or None
    stages_on_processes: bool  # Distributed.stagesOnProcesses: one process per stage

    @classmethod
    def of(cls, options: OptionsView) -> DistributedConfig:
        """The configuration of ``options`` (a ``poptorch.Options``) for processes."""
        strategy = options.execution_strategy
        return cls(
            process_id=int(options.Distributed.processId),
            num_processes=int(options.Distributed.numProcesses),
            broadcast_buffers=bool(options.broadcast_buffers),
            input_group_size=int(options.input_group_size),
            input_cgt=CommGroupType(options.input_cgt),
            strategy_name=None if strategy is None else type(strategy).__name__,
            stages_on_processes=bool(options.Distributed.stages_on_processes))


@dataclass(frozen=True)
class RuntimeConfig:
    """What the engine reads of the options of one compiled model."""
    device_iterations: int
    replication_factor: int
    output_mode: OutputMode | int
    output_return_period: int
    random_seed: int | None
    anchored_tensors: Mapping[str, Mapping[str, OptionValue]]
    profile_dir: str | None
    synthetic_mode: int  # PopART's synthetic data: 0 off, 1 zeros, 2 random normal
    training: TrainingConfig
    precision: PrecisionConfig
    locations: LocationsConfig
    distributed: DistributedConfig
    placement: PlacementConfig

    @classmethod
    def of(cls, options: OptionsView) -> RuntimeConfig:
        """The configuration of ``options`` (a ``poptorch.Options``) as it is now."""
        training = options.Training
        return cls(
            device_iterations=int(options.device_iterations),
            replication_factor=int(options.replication_factor),
            output_mode=options.output_mode,
            output_return_period=int(options.output_return_period),
            random_seed=int(options.random_seed) if options.exists("random_seed") else None,
            anchored_tensors=types.MappingProxyType(
                {k: types.MappingProxyType(dict(v))
                 for k, v in options.anchored_tensors.items()}),
            profile_dir=options.profile_dir,
            synthetic_mode=int(options._synthetic_data_mode()),
            training=TrainingConfig(
                gradient_accumulation=int(training.gradient_accumulation),
                reduction=ReductionType(training.accumulation_and_replication_reduction_type),
                mean_strategy=MeanReductionStrategy(
                    training.meanAccumulationAndReplicationReductionStrategy),
                automatic_loss_scaling=bool(training.automatic_loss_scaling)),
            precision=PrecisionConfig.of(options.Precision),
            locations=LocationsConfig.of(options),
            distributed=DistributedConfig.of(options),
            placement=PlacementConfig.of(options))


@dataclass(frozen=True)
class PlacementConfig:
    """What model parallelism (``_runtime/placement/``) reads of the options.

    ``strategy`` is the execution strategy in force (the default ``PipelinedExecution``
    when none was set; ``strategy_given`` tells which): an object, because the runner
    publishes the schedule it ran on it (``last_schedule``). ``device_options`` is a
    copy of the options taken now, handed only to ``poptorch._devices`` to pick the
    devices that play the IPUs (IPU model, ids, rounding, replicas).
    ``module_calls_rewritten``: a torch function mode rewrites module calls at run time
    (PopART's strided group norm), so the stage graph keeps the calls (torch.fx first)."""
    strategy: ExecutionStrategy
    strategy_given: bool
    weight_locations: Mapping[str, OptionValue]
    activation_locations: Mapping[str, OptionValue]
    device_options: OptionsView
    module_calls_rewritten: bool = False

    @classmethod
    def of(cls, options: OptionsView) -> PlacementConfig:
        """The placement configuration of ``options`` as it is now."""
        locations = getattr(options, "TensorLocations", None)
        return cls(
            strategy=options._execution_strategy,
            strategy_given=options.execution_strategy is not None,
            weight_locations=types.MappingProxyType(
                dict(getattr(locations, "location_weight", {}) or {})),
            activation_locations=types.MappingProxyType(
                dict(getattr(locations, "location_activation", {}) or {})),
            device_options=options.clone(),
            module_calls_rewritten=bool(
                getattr(getattr(options, "_Popart", None), "options", {}).get(
                    "groupNormStridedChannelGrouping", False)))
