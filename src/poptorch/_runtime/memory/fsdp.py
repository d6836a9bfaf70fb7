"""Weights and gradient accumulators sharded over the processes of a run (replicated
tensor sharding), built on torch's FSDP2 (``torch.distributed.fsdp.fully_shard``).

``Options.TensorLocations`` asks for it:

* weights, ``useReplicatedTensorSharding(True)``: every process holds ``1/n`` of each
  weight of at least ``minElementsForReplicatedTensorSharding`` elements between
  steps (a DTensor parameter, ``Shard(0)``); a unit's weights are all-gathered before
  its forward, freed after it (``reshard_after_forward=True``), gathered again for its
  backward and freed after it; the next unit's gather is prefetched
  (``set_modules_to_forward_prefetch`` / ``set_modules_to_backward_prefetch``), so at
  most two units' whole weights exist at once (ZeRO-3 with the accumulators);
* accumulators, ``useReplicatedTensorSharding(True)``: the gradients are
  reduce-scattered after every micro-batch, each process accumulating only its shard
  across ``gradientAccumulation`` micro-batches (ZeRO-2 with whole weights in the step:
  ``reshard_after_forward=False``). Without it, the micro-batches but the last
  accumulate whole gradients locally (``set_requires_gradient_sync(False)``) and the last
  reduce-scatters the sum, as unsharded accumulators do;
* weights or accumulators, ``useOnChipStorage(False)``: the shards and their gradients
  live in (pinned) host memory, FSDP2's ``CPUOffloadPolicy``; on the CPU host memory is
  the device's and this changes nothing (logged once at INFO).

The units are the model's top-level children that hold parameters (descending into
containers without parameters of their own: a ``ModuleList`` of blocks gives its
blocks), then the model itself (whose own parameters, and every parameter under the
size threshold, stay whole on every process: ``ignored_params``, reduced by the
processes' all-reduce). The optimizer steps the shards (``fsdp_step.ShardedStep``).
Reading the model gives whole tensors: ``state_dict()`` of a unit all-gathers its
weights (``DTensor.full_tensor()``, a collective: every process must call it, as for
FSDP's full state dict) and ``load_state_dict`` takes each process's rows of whole
tensors (no collective).
"""
from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from types import TracebackType
from typing import cast

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor.experimental import implicit_replication
from torch.utils.hooks import RemovableHandle

from ..._logging import info_once
from ..._typing import OptionValue, StateDict
from ..distributed.world import World
from ..schedule.actions import Action, ActionKind
from .layout import DEFAULT_MIN_ELEMENTS

# Use FSDP2's offload path on the CPU too (its moves are no-ops there): tests set it to
# check the off-chip code path, as ``offload.StateStorage(force_stream=True)``.
force_stream = False


@dataclass(frozen=True)
class WeightPlacement:
    """What ``Options.TensorLocations`` asks of the weights and accumulators."""
    weights_rts: bool
    accumulators_rts: bool
    off_chip: bool  # weights or accumulators useOnChipStorage(False)
    min_elements: int

    @classmethod
    def of(cls, weight: Mapping[str, OptionValue], accumulator: Mapping[str, OptionValue]
           ) -> WeightPlacement:
        """From the weight and accumulator settings (``TensorLocationSettings.toDict()``);
        the threshold is the weights' (the accumulators' when only they are sharded)."""
        weights_rts = bool(weight.get("useReplicatedTensorSharding"))
        accumulators_rts = bool(accumulator.get("useReplicatedTensorSharding"))
        source = weight if weights_rts or not accumulators_rts else accumulator
        return cls(weights_rts=weights_rts, accumulators_rts=accumulators_rts,
                   off_chip=weight.get("onChip") is False
                   or accumulator.get("onChip") is False,
                   min_elements=int(source.get("minElementsForReplicatedTensorSharding",
                                               DEFAULT_MIN_ELEMENTS)))

    @property
    def sharded(self) -> bool:
        """Whether weights or accumulators are sharded over the processes."""
        return self.weights_rts or self.accumulators_rts


def units_of(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules sharded one by one, in the order their forwards run (module
    docstring): children with parameters; a child with no parameters of its own and
    several children with parameters is a container, whose children are the units."""
    units: list[torch.nn.Module] = []
    for child in model.children():
        if not any(True for _ in child.parameters()):
            continue
        own = any(True for _ in child.parameters(recurse=False))
        holders = [c for c in child.children() if any(True for _ in c.parameters())]
        if not own and len(holders) > 1:
            units.extend(units_of(child))
        else:
            units.append(child)
    return units


def planned_actions(units: int, microbatches: int, *, reshard_after_forward: bool,
                    sync_every_microbatch: bool) -> list[Action]:
    """The memory movements of one training step as actions (``schedule.actions``):
    per micro-batch, each unit's gather (the next unit's prefetched while it computes),
    forward and drop; backward in reverse with its gather, drop and reduce-scatter; the
    update on the shards. Stage ``u`` is unit ``u``."""
    k = ActionKind
    plan: list[Action] = []
    gathered: set[int] = set()

    def gather(u: int, mb: int) -> None:
        if 0 <= u < units and u not in gathered:
            gathered.add(u)
            plan.append(Action(k.ALL_GATHER, u, mb))

    def drop(u: int, mb: int) -> None:
        gathered.discard(u)
        plan.append(Action(k.DROP, u, mb))

    for mb in range(microbatches):
        for u in range(units):
            gather(u, mb)
            gather(u + 1, mb)  # forward prefetch
            plan.append(Action(k.FORWARD, u, mb))
            if reshard_after_forward:
                drop(u, mb)
        sync = sync_every_microbatch or mb == microbatches - 1
        for u in reversed(range(units)):
            gather(u, mb)
            gather(u - 1, mb)  # backward prefetch
            plan.append(Action(k.BACKWARD, u, mb))
            drop(u, mb)
            if sync:
                plan.append(Action(k.REDUCE_SCATTER, u, mb))
    plan.append(Action(k.UPDATE, 0))
    return plan


def peak_gathered(actions: list[Action]) -> int:
    """The most units whose whole weights exist at once while ``actions`` run."""
    live: set[int] = set()
    peak = 0
    for action in actions:
        if action.kind == ActionKind.ALL_GATHER:
            live.add(action.stage)
            peak = max(peak, len(live))
        elif action.kind == ActionKind.DROP:
            live.discard(action.stage)
    return peak


@dataclass
class Accounting:
    """The runtime's own count of weight bytes materialized at once: at every forward
    and backward boundary of a unit, the units whose parameters are whole (FSDP2 swaps
    a gathered unit's DTensor parameters for whole tensors) plus the prefetched one."""
    shard_bytes: int = 0
    unit_bytes: list[int] = field(default_factory=list)
    peak_bytes: int = 0
    peak_units: int = 0

    def sample(self, units: list[torch.nn.Module], prefetched: int) -> None:
        """Record the weights whole now; ``prefetched``: a unit whose gather is in
        flight (-1 for none)."""
        whole = {u for u, unit in enumerate(units) if unit_is_whole(unit)}
        if prefetched >= 0:
            whole.add(prefetched)
        self.peak_units = max(self.peak_units, len(whole))
        self.peak_bytes = max(self.peak_bytes, self.shard_bytes + sum(
            self.unit_bytes[u] for u in whole))

    def reset(self) -> None:
        self.peak_bytes = self.peak_units = 0


def unit_is_whole(unit: torch.nn.Module) -> bool:
    """Whether ``unit``'s sharded parameters are gathered (whole tensors) now."""
    params = list(unit.parameters(recurse=True))
    return bool(params) and not any(isinstance(p, DTensor) for p in params) and \
        getattr(unit, "_poptorch_sharded", False)


class ShardedModel:
    """A model whose units are ``fully_shard``-ed over ``world`` (module docstring)."""

    def __init__(self, model: torch.nn.Module, world: World, placement: WeightPlacement,
                 device: torch.device, per_step: int) -> None:
        self.model = model
        self.placement = placement
        self.world = world
        self.per_step = per_step  # training micro-batches per optimizer step
        self.count = 0  # training forwards of this step so far
        self.compiled_units = False  # the units' forwards compiled (compile_units)
        self.units = units_of(model)
        before = dict(model.named_parameters())
        self.ignored = {p for p in before.values()
                        if p.numel() < max(placement.min_elements, 1) or not p.requires_grad}
        self.ignored.update(model.parameters(recurse=False))
        assert world.group is not None  # (several processes)
        mesh = DeviceMesh.from_group(world.group, device.type)
        offload: OffloadPolicy = OffloadPolicy()
        if placement.off_chip:
            if device.type == "cpu" and force_stream:
                offload = CPUOffloadPolicy(pin_memory=False)
            elif device.type == "cpu":
                info_once(("off-chip", "weight", "fsdp"), "TensorLocations: weights / "
                          "accumulators off chip (useOnChipStorage(False)) change nothing "
                          "on the CPU, where host memory is the device's.")
            else:
                offload = CPUOffloadPolicy(pin_memory=True)
        reshard = placement.weights_rts
        for unit in self.units:
            fully_shard(unit, mesh=mesh, reshard_after_forward=reshard,
                        offload_policy=offload, ignored_params=self.ignored)
            object.__setattr__(unit, "_poptorch_sharded", True)
        fully_shard(model, mesh=mesh, reshard_after_forward=reshard,
                    offload_policy=offload, ignored_params=self.ignored)
        self.root: FSDPModule = model  # type: ignore[assignment]
        self._prefetch()
        after = dict(model.named_parameters())
        #: the parameter that replaced each one (the same object when kept whole)
        self.replaced: dict[int, torch.nn.Parameter] = {
            id(before[name]): after[name] for name in before}
        self.accounting = Accounting(
            shard_bytes=sum(_local(p).numel() * p.element_size() for p in after.values()
                            if isinstance(p, DTensor)),
            unit_bytes=[sum(p.numel() * p.element_size() for p in unit.parameters()
                            if isinstance(p, DTensor)) for unit in self.units])
        self._hooks = [h for u, unit in enumerate(self.units) for h in self._watch(u, unit)]
        for unit in self.units:
            unit.register_state_dict_post_hook(_whole_state)
            unit.register_load_state_dict_pre_hook(_sharded_state)
        model.register_forward_pre_hook(self._before_forward)

    def compile_units(self, backend: str, label: str) -> None:
        """The compiled backend with sharded weights: each unit's forward compiled on
        its own (``nn.Module.compile``), FSDP2's gathers and reduce-scatters between
        them (dynamo leaves FSDP2's hooks out of the graphs), as torchtitan composes
        FSDP2 with ``torch.compile`` block by block."""
        options = {"fallback_random": True} if backend == "inductor" else None
        for unit in self.units:
            unit.compile(backend=backend, options=options)
        self.compiled_units = True
        info_once(("fsdp-compiled", label), "%s: weights sharded over the processes "
                  "(FSDP2): each of its %d blocks compiled on its own, the gathers "
                  "between them.", label, len(self.units))

    # --- the schedule FSDP2 runs ---------------------------------------------------
    def _prefetch(self) -> None:
        """Explicit prefetch: each unit gathers the next one's weights in its forward
        and the previous one's in its backward."""
        units = cast("list[FSDPModule]", self.units)  # (made FSDP modules by fully_shard)
        for before, after in itertools.pairwise(units):
            before.set_modules_to_forward_prefetch([after])
            after.set_modules_to_backward_prefetch([before])

    def _watch(self, u: int, unit: torch.nn.Module) -> Iterator[RemovableHandle]:
        """Hooks sampling the accounting at the unit's forward and backward."""
        n = len(self.units)
        accounting = self.accounting
        units = self.units

        def forward_pre(*_: object) -> None:
            accounting.sample(units, u + 1 if u + 1 < n else -1)

        def backward_pre(*_: object) -> None:
            accounting.sample(units, u - 1)
        yield unit.register_forward_pre_hook(forward_pre)
        yield unit.register_full_backward_pre_hook(backward_pre)

    def plan(self, microbatches: int) -> list[Action]:
        """The memory actions of a step of ``microbatches`` micro-batches."""
        return planned_actions(len(self.units), microbatches,
                               reshard_after_forward=self.placement.weights_rts,
                               sync_every_microbatch=self.placement.accumulators_rts)

    def begin_step(self) -> None:
        """Before the micro-batches of a training step."""
        self.count = 0
        self.accounting.reset()

    def _before_forward(self, *_: object) -> None:
        """Before a forward of the model: a training micro-batch's backward
        reduce-scatters with sharded accumulators, else only the step's last one does
        (the others accumulate whole gradients locally, as unsharded accumulators)."""
        if not torch.is_grad_enabled():
            return
        self.count += 1
        last = self.count % self.per_step == 0
        self.root.set_requires_gradient_sync(last or self.placement.accumulators_rts)

    # --- parameters replaced -------------------------------------------------------
    def rebind(self, optimizer: torch.optim.Optimizer | None) -> None:
        """Point ``optimizer``'s param groups and state at the sharded parameters (its
        whole state is cut into shards at the first step: ``fsdp_step``)."""
        if optimizer is None:
            return
        for group in optimizer.param_groups:
            group["params"] = [self.replaced.get(id(p), p) for p in group["params"]]
        state = optimizer.state
        for old in list(state):
            new = self.replaced.get(id(old), old)
            if new is not old:
                state[new] = state.pop(old)

    @property
    def whole_params(self) -> list[torch.nn.Parameter]:
        """The trainable parameters every process keeps whole (reduced by all-reduce)."""
        return [p for p in self.model.parameters()
                if not isinstance(p, DTensor) and p.requires_grad]


class WholeAsReplicated:
    """Entered around every call of a program with sharded weights: a plain tensor
    meeting a DTensor (the step's gradient scaling runs one ``foreach`` over the
    parameters kept whole and the sharded ones) counts as replicated on every process,
    which the whole parameters are (``implicit_replication``)."""

    def __init__(self) -> None:
        self._active: list[AbstractContextManager[object]] = []

    def __enter__(self) -> None:
        scope = implicit_replication()
        scope.__enter__()
        self._active.append(scope)

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._active.pop().__exit__(exc_type, exc, tb)


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if isinstance(p, DTensor) else p


def _whole_state(module: torch.nn.Module, state: StateDict, prefix: str,
                 local_metadata: object) -> None:
    """State-dict post hook of a unit: its sharded entries as whole tensors."""
    for key, value in list(state.items()):
        if key.startswith(prefix) and isinstance(value, DTensor):
            state[key] = value.full_tensor()


def _sharded_state(module: torch.nn.Module, state: StateDict, prefix: str,
                   *args: object) -> None:
    """Load-state-dict pre hook of a unit: whole tensors become this process's shard
    of the parameter they load into (each process cuts its own rows)."""
    params = dict(module.named_parameters())
    for name, p in params.items():
        key = prefix + name
        value = state.get(key)
        if isinstance(p, DTensor) and isinstance(value, torch.Tensor) and \
                not isinstance(value, DTensor):
            state[key] = distribute_tensor(value.to(_local(p).device), p.device_mesh,
                                           p.placements, src_data_rank=None)
