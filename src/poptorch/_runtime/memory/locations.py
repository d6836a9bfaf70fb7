"""What ``Options.TensorLocations`` does to a compiled training model outside phased
execution (which streams its phases' weights and activations itself:
``_runtime/placement/phased.py``).

* optimizer state, ``useReplicatedTensorSharding(True)``: sharded over the replicas
  sharing each tensor of at least ``minElementsForReplicatedTensorSharding`` elements
  (``layout.py``, ``sharding.py``);
* optimizer state, ``useOnChipStorage(False)``: in host memory between steps
  (``offload.py``);
* activations, ``useOnChipStorage(False)``: saved for the backward pass in host memory;
* weights and accumulators, ``useReplicatedTensorSharding(True)`` across processes (one
  replica each): sharded with FSDP2 (``fsdp.py``, joined in ``executor/processes.py``),
  the optimizer stepping the shards (``fsdp_step.py``); off chip with them: FSDP2's
  ``CPUOffloadPolicy`` on GPUs. For an execution strategy's stages: sharded between
  steps (``step_shards.py``);
* weights, ``useOnChipStorage(False)``, in one process: streamed block by block from
  host memory (``streamed_weights.py``; phased execution streams its own).
  Otherwise recorded and logged once at INFO.

On the CPU, host memory is the device's: off-chip storage is logged once at INFO and
changes nothing.
"""
from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..._logging import info_once
from ..._typing import OptionValue
from ...enums import CommGroupType, VariableRetrievalMode
from ..config import LocationsConfig
from ..distributed.replicas import DataParallelGroup
from ..distributed.world import SINGLE_PROCESS
from ..program.replica_groups import group_count, group_of
from . import fsdp
from .fsdp import WholeAsReplicated, units_of
from .fsdp_step import ShardedStep
from .layout import DEFAULT_MIN_ELEMENTS, plan_layout
from .offload import ActivationsOffChip, StateStorage
from .sharding import ManagedStep, take_over
from .step_shards import StepShardedStep, gather_released
from .streamed_weights import StreamedWeights

if TYPE_CHECKING:
    from ..distributed.stage_processes import StageReplicaGroup

# Optimizers whose update of each element depends on that element only (piece by piece
# is the same update); others are sharded tensor by tensor.
_ELEMENTWISE = {"SGD", "Adam", "AdamW", "RMSprop", "Adagrad", "Adamax", "NAdam", "RAdam"}


def elementwise(optimizer: object) -> bool:
    """Whether ``optimizer``'s update may run on any piece of a tensor on its own."""
    cls = type(optimizer)
    return cls.__name__ in _ELEMENTWISE and cls.__module__.startswith(
        ("poptorch.optim", "torch.optim"))


def _settings(locations: LocationsConfig, kind: str) -> dict[str, OptionValue]:
    return dict(getattr(locations, kind))


def slot_members(params: list[torch.nn.Parameter], names: dict[int, str],
                 groupings: dict | None, replicas: int) -> dict[int, list[list[int]]]:
    """For each replica-grouped parameter (by index): the global replicas sharing each
    slice of its first dimension."""
    result: dict[int, list[list[int]]] = {}
    for i, p in enumerate(params):
        grouping = (groupings or {}).get(names.get(id(p)))
        if grouping is None:
            continue
        kind, size, mode = grouping
        kind, mode = CommGroupType(kind), VariableRetrievalMode(mode)
        if kind == CommGroupType.All:
            continue
        if mode == VariableRetrievalMode.AllReplicas:
            result[i] = [[k] for k in range(replicas)]
            continue
        members: list[list[int]] = [[] for _ in range(group_count(replicas, kind, size))]
        for k in range(replicas):
            members[group_of(k, replicas, kind, size)].append(k)
        result[i] = members
    return result


@dataclass(frozen=True)
class LocationEffects:
    """What the tensor locations add to a device program."""
    # replaces the optimizer's own step (sharded or off-chip state, streamed weights)
    managed_step: Callable[[], object] | None = None
    # entered around every call (activations off chip)
    wrappers: tuple[AbstractContextManager[object], ...] = ()
    # taken off the model when the program is dropped (streamed weights' hooks)
    hooks: tuple[StreamedWeights, ...] = ()


def install(model: torch.nn.Module, locations: LocationsConfig, groupings: dict | None,
            device: torch.device, *, training: bool,
            optimizer: Callable[[], torch.optim.Optimizer | None],
            cross: DataParallelGroup | StageReplicaGroup | None, replicas: int,
            host: torch.nn.Module | None = None, unsplit: bool = False) -> LocationEffects:
    """Make the tensor ``locations`` (``Options.TensorLocations`` as compiled) act on a
    program of ``model`` (module docstring). ``optimizer()`` returns the optimizer in
    force (``setOptimizer`` may bind another), ``cross`` the program's cross-process
    side (None in one process), ``replicas`` its replicas per process, ``host`` the
    user's module; ``unsplit``: the program runs the model itself (its blocks' module
    hooks run)."""
    phased = locations.phased
    cpu = device.type == "cpu"
    alone = unsplit and cross is None and replicas == 1  # the model itself, one copy
    streamed = _streamed_weights(model, locations, device, alone and not phased)
    if getattr(cross, "sharded", None) is None and (
            not isinstance(cross, DataParallelGroup) or cross.step_placement is None):
        _log_recorded(locations, cpu, phased, streaming=alone)
    wrappers: tuple[AbstractContextManager[object], ...] = () if streamed is None \
        else (streamed,)
    if not training:
        effects = _activation_effects(locations, device, training, phased, wrappers)
    else:
        effects = _optimizer_effects(model, locations, groupings, device, optimizer,
                                     cross, replicas, host, wrappers)
    if streamed is None:
        return effects
    return LocationEffects(managed_step=None if not training else
                           streamed.update(effects.managed_step, optimizer),
                           wrappers=effects.wrappers, hooks=(streamed,))


def _streamed_weights(model: torch.nn.Module, locations: LocationsConfig,
                      device: torch.device, possible: bool) -> StreamedWeights | None:
    """Weights off chip streamed block by block (``streamed_weights``), where they can
    be: the model itself in one process with one replica, outside phased execution."""
    weight_loc = _settings(locations, "weight")
    if weight_loc.get("onChip") is not False or not possible:
        return None
    if device.type == "cpu" and not fsdp.force_stream:
        info_once(("off-chip", "weight", "stream"), "TensorLocations: weights off chip "
                  "(useOnChipStorage(False)) change nothing on the CPU, where host memory "
                  "is the device's.")
        return None
    units = units_of(model)
    info_once(("off-chip", "weight", "stream", len(units)), "TensorLocations: weights off "
              "chip, streamed to the device block by block (%d blocks).", len(units))
    return StreamedWeights(units, device, int(weight_loc.get("minElementsForOffChip", 0)))


def _optimizer_effects(model: torch.nn.Module, locations: LocationsConfig,
                       groupings: dict | None, device: torch.device,
                       optimizer: Callable[[], torch.optim.Optimizer | None],
                       cross: DataParallelGroup | StageReplicaGroup | None, replicas: int,
                       host: torch.nn.Module | None,
                       wrappers: tuple[AbstractContextManager[object], ...]
                       ) -> LocationEffects:
    """The effects of a training program's locations but streamed weights."""
    optimizer_loc = _settings(locations, "optimizer")
    phased = locations.phased
    cpu = device.type == "cpu"
    wrappers = _activation_effects(locations, device, True, phased, wrappers).wrappers
    off_chip = optimizer_loc.get("onChip") is False
    if off_chip and cpu:
        info_once(("off-chip", "optimizer"), "TensorLocations: optimizer state off chip "
                  "(useOnChipStorage(False)) changes nothing on the CPU, where host memory "
                  "is the device's.")
    sharding = bool(optimizer_loc.get("useReplicatedTensorSharding"))
    world = cross.world if cross is not None else SINGLE_PROCESS
    r = replicas
    params = list(model.parameters())
    names = {id(p): n for n, p in model.named_parameters()}
    current = optimizer()
    if current is not None:
        take_over(current)  # a program compiled again: the previous one's pieces
    sharded_weights = getattr(cross, "sharded", None)
    if sharded_weights is not None:
        # The optimizer state follows the weights' shards (FSDP2's DTensor parameters).
        storage = StateStorage(off_chip and not cpu,
                               int(optimizer_loc.get("minElementsForOffChip", 0)))
        info_once(("rts", "fsdp", world.size), "TensorLocations: weights%s sharded over "
                  "%d processes (FSDP2, %d unit(s)); the optimizer state with them.",
                  "" if sharded_weights.placement.weights_rts else
                  " (between steps) and gradient accumulators", world.size,
                  len(sharded_weights.units))
        return LocationEffects(managed_step=ShardedStep(optimizer, params, world, storage),
                               wrappers=(*wrappers, WholeAsReplicated()))
    if isinstance(cross, DataParallelGroup) and cross.step_placement is not None:
        between_steps = cross.step_placement
        # Weights / accumulators of a strategy's stages: sharded between steps.
        layout = plan_layout(params, min_elements=between_steps.min_elements,
                             replicas_per_process=1, processes=world.size,
                             elementwise=elementwise(current))
        storage = StateStorage(off_chip and not cpu,
                               int(optimizer_loc.get("minElementsForOffChip", 0)))
        info_once(("rts", "step", world.size), "TensorLocations: weights%s sharded over "
                  "%d processes between steps (whole during a step of the execution "
                  "strategy's stages); the optimizer state with them.",
                  "" if between_steps.weights_rts else " and gradient accumulators",
                  world.size)
        step = StepShardedStep(optimizer, params, layout, world, storage, host or model,
                               off_chip=between_steps.off_chip and not cpu,
                               flatten=not phased)
        cross.before_step = gather_released
        return LocationEffects(managed_step=step, wrappers=wrappers)
    if sharding:
        min_elements = int(optimizer_loc.get("minElementsForReplicatedTensorSharding",
                                             DEFAULT_MIN_ELEMENTS))
        layout = plan_layout(params, min_elements=min_elements, replicas_per_process=r,
                             processes=world.size, elementwise=elementwise(current),
                             slot_members=slot_members(params, names, groupings,
                                                       r * world.size))
    else:
        layout = plan_layout(params, min_elements=0, replicas_per_process=1,
                             processes=1, elementwise=True)
    storage = StateStorage(off_chip and not cpu,
                           int(optimizer_loc.get("minElementsForOffChip", 0)))
    if sharding and not layout.sharded:
        info_once(("rts", "single replica"), "TensorLocations: replicated tensor sharding "
                  "of the optimizer state has nothing to shard (one replica, or no tensor "
                  "of at least %d elements).", min_elements)
    if not layout.sharded and not storage.off_chip:
        return LocationEffects(wrappers=wrappers)
    if layout.sharded:
        info_once(("rts", r, world.size), "TensorLocations: optimizer state of %d tensor(s) "
                  "sharded over %d replica(s) (%d per process).",
                  len({q.param for q in layout.pieces}), r * world.size, r)
    # Phased execution moves each weight between devices (its storage changes), so the
    # weights cannot live in the buckets there.
    managed = ManagedStep(optimizer, params, layout, world, storage, flatten=not phased)
    return LocationEffects(managed_step=managed, wrappers=wrappers)


def _activation_effects(locations: LocationsConfig, device: torch.device, training: bool,
                        phased: bool, wrappers: tuple[AbstractContextManager[object], ...]
                        ) -> LocationEffects:
    """``wrappers`` and activations off chip (saved for the backward in host memory)."""
    activation_loc = _settings(locations, "activation")
    if activation_loc.get("onChip") is False and training and not phased:
        if device.type == "cpu":
            info_once(("off-chip", "activation"), "TensorLocations: activations off chip "
                      "(useOnChipStorage(False)) change nothing on the CPU, where host "
                      "memory is the device's.")
        else:
            wrappers = (*wrappers, ActivationsOffChip())
    return LocationEffects(wrappers=wrappers)


def _log_recorded(locations: LocationsConfig, cpu: bool, phased: bool,
                  streaming: bool) -> None:
    """One INFO line per location setting that is recorded only."""
    for kind in ("weight", "accumulator"):
        settings = _settings(locations, kind)
        if settings.get("useReplicatedTensorSharding"):
            info_once(("rts", kind), "TensorLocations: replicated tensor sharding of %ss is "
                      "recorded; every replica holds the whole %ss (they are sharded "
                      "across processes with one replica each).", kind, kind)
        if settings.get("onChip") is False and not (kind == "weight"
                                                    and (phased or streaming)):
            info_once(("off-chip", kind), "TensorLocations: %ss off chip are recorded; "
                      "they stay in device memory%s.", kind,
                      "" if cpu else " (off-chip weights stream in phased execution only)")
