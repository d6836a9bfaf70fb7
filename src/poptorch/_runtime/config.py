"""The options as the engine reads them: a frozen, typed configuration made once, when a
model compiles (``RuntimeConfig.of``), from the user's ``poptorch.Options``.

The PopTorch setter façade (``options/``) stays the user's interface; the device loop,
the loss scaler, the anchors and the profiler read this snapshot instead, so a later
change of an options object (a clone, another model's) can never reach a compiled
program, and each engine module states exactly what it reads.
"""
from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any, Mapping

from ..enums import MeanReductionStrategy, OutputMode, ReductionType

__all__ = ["PlacementConfig", "RuntimeConfig", "TrainingConfig"]


@dataclass(frozen=True)
class TrainingConfig:
    """``Options.Training`` as the training step reads it."""
    gradient_accumulation: int
    reduction: ReductionType
    mean_strategy: MeanReductionStrategy
    automatic_loss_scaling: bool


@dataclass(frozen=True)
class RuntimeConfig:
    """What the engine reads of the options of one compiled model."""
    device_iterations: int
    replication_factor: int
    output_mode: OutputMode | int
    output_return_period: int
    random_seed: int | None
    anchored_tensors: Mapping[str, Mapping[str, Any]]
    profile_dir: str | None
    training: TrainingConfig
    placement: "PlacementConfig"

    @classmethod
    def of(cls, options: Any) -> "RuntimeConfig":
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
            training=TrainingConfig(
                gradient_accumulation=int(training.gradient_accumulation),
                reduction=ReductionType(training.accumulation_and_replication_reduction_type),
                mean_strategy=MeanReductionStrategy(
                    training.meanAccumulationAndReplicationReductionStrategy),
                automatic_loss_scaling=bool(training.automatic_loss_scaling)),
            placement=PlacementConfig.of(options))


@dataclass(frozen=True)
class PlacementConfig:
    """What model parallelism (``_runtime/placement/``) reads of the options.

    ``strategy`` is the execution strategy in force (the default ``PipelinedExecution``
    when none was set; ``strategy_given`` tells which): an object, because the runner
    publishes the schedule it ran on it (``last_schedule``). ``device_options`` is a
    copy of the options taken now, handed only to ``poptorch._devices`` to pick the
    devices that play the IPUs (IPU model, ids, rounding, replicas)."""
    strategy: Any
    strategy_given: bool
    weight_locations: Mapping[str, Any]
    activation_locations: Mapping[str, Any]
    device_options: Any

    @classmethod
    def of(cls, options: Any) -> "PlacementConfig":
        """The placement configuration of ``options`` as it is now."""
        locations = getattr(options, "TensorLocations", None)
        return cls(
            strategy=options._execution_strategy,
            strategy_given=options.execution_strategy is not None,
            weight_locations=types.MappingProxyType(
                dict(getattr(locations, "location_weight", {}) or {})),
            activation_locations=types.MappingProxyType(
                dict(getattr(locations, "location_activation", {}) or {})),
            device_options=options.clone())
