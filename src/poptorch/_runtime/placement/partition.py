"""Discovering a model's blocks and resolving them into stages (and phases).

PopTorch "traces" the model once at compile time: :func:`trace_blocks` runs the forward
pass of the first micro-batch without gradients (buffers and the random generators are
restored afterwards) and records the blocks the model enters, in order, and which
parameters and buffers each block uses. :func:`resolve_partition` then applies the
execution strategy and enforces the rules of the user guide, raising
:py:class:`poptorch.Error` naming the offending block.
"""
from __future__ import annotations

import itertools
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode

from ...enums import AutoStage
from ...errors import Error
from .. import context
from ..config import RuntimeConfig
from ..torch_internals import pytree
from . import markers
from .strategy import PARALLEL_PHASED, PIPELINED, ExecutionStrategy, is_phased, kind_of

IMPLICIT_BLOCK = "<before first block>"


class BlockNamer:
    """Turns the ``user_id`` given to a block into its block id (auto ids for None)."""

    def __init__(self) -> None:
        self._next_auto = 0

    def reset_auto_id(self) -> None:
        self._next_auto = 0

    def name(self, user_id: markers.BlockId) -> str:
        if user_id is None:
            user_id = self._next_auto
            self._next_auto += 1
        return str(user_id)


@dataclass
class BlockTrace:
    """What one traced forward pass showed."""
    sequence: list[str] = field(default_factory=list)  # block ids, in the order entered
    ipu_of: dict[str, int | None] = field(default_factory=dict)
    users: dict[int, list[str]] = field(default_factory=dict)  # id(param/buffer) -> blocks
    tensor_names: dict[int, str] = field(default_factory=dict)
    begin_block_layers: list[markers.BeginBlockHook] = field(default_factory=list)  # in call order


class _Tracer(TorchFunctionMode):
    """Block listener + torch function mode recording blocks and weight usage."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.trace = BlockTrace()
        self.namer = BlockNamer()
        self.current: str | None = None
        self._weights = {id(t): n for n, t in model.named_parameters()}
        self._weights.update({id(t): n for n, t in model.named_buffers()})
        self.trace.tensor_names = dict(self._weights)

    # block listener
    def reset_auto_id(self) -> None:
        self.namer.reset_auto_id()

    def begin_block(self, user_id: str | int | None, ipu_id: int | None,
                    layer: torch.nn.Module | None = None) -> None:
        block = self.namer.name(user_id)
        known = self.trace.ipu_of.get(block, ipu_id)
        if block in self.trace.ipu_of and ipu_id is not None and known != ipu_id:
            raise Error(f"Block {block!r} is placed on IPU {known} and on IPU {ipu_id}: "
                        "blocks with the same user_id are one block and run on one IPU.")
        self.trace.ipu_of[block] = ipu_id if known is None else known
        if layer is not None:
            hook = markers.begin_block_of(layer)
            if hook is not None and hook not in self.trace.begin_block_layers:
                self.trace.begin_block_layers.append(hook)
        if not self.trace.sequence or self.trace.sequence[-1] != block:
            self.trace.sequence.append(block)
        self.current = block

    def checkpoint(self, tensors: list) -> list:
        return tensors

    # torch function mode
    def __torch_function__(self, func: Callable[..., object], types: Collection[type],
                           args: tuple[object, ...] = (),
                           kwargs: dict[str, object] | None = None) -> object:
        kwargs = kwargs or {}
        for t in pytree.tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor) and id(t) in self._weights:
                block = self.current if self.current is not None else self._enter_implicit()
                users = self.trace.users.setdefault(id(t), [])
                if block not in users:
                    users.append(block)
        if self.current is None:
            self._enter_implicit()
        return func(*args, **kwargs)

    def _enter_implicit(self) -> str:
        """Enter the implicit block (code before the first block); returns its id."""
        self.current = IMPLICIT_BLOCK
        self.trace.sequence.append(IMPLICIT_BLOCK)
        self.trace.ipu_of[IMPLICIT_BLOCK] = 0
        return IMPLICIT_BLOCK


def has_static_annotations(model: torch.nn.Module) -> bool:
    """True when BeginBlock / LegacyBeginBlockFn / IPU annotations are visible in the
    module tree (Block and BlockFunction only show when forward runs)."""
    return any(
        markers.starts_block(m)
        for m in model.modules())


def trace_blocks(model: torch.nn.Module, args: tuple, kwargs: dict,
                 strategy: ExecutionStrategy) -> BlockTrace:
    """Run ``model`` once without side effects and record its blocks (module docstring)."""
    tracer = _Tracer(model)
    saved_buffers = [(b, b.detach().clone()) for b in model.buffers()]
    cuda = [torch.cuda.current_device()] if torch.cuda.is_initialized() else []
    strategy.onStartTracing()
    previous = markers.set_listener(tracer)
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=cuda), \
                context.running_on_ipu(), tracer:
            model(*args, **kwargs)
    finally:
        markers.set_listener(previous)
        strategy.onEndTracing()
        context.take_marked_losses()
        with torch.no_grad():
            for buffer, value in saved_buffers:
                buffer.copy_(value)
    return tracer.trace


@dataclass
class StagePlan:
    index: int  # position in execution order
    ipu: int
    blocks: list[str]
    phase: int | None = None


@dataclass
class Partition:
    """The resolved partition of a model."""
    strategy: ExecutionStrategy
    stages: list[StagePlan]
    block_stage: dict[str, int]
    sequence: list[str]
    num_ipus: int
    weight_stage: dict[int, int]  # id(param/buffer) -> stage index
    num_phases: int = 0

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def has_blocks(self) -> bool:
        return any(b != IMPLICIT_BLOCK for b in self.sequence)


def _kind(strategy: ExecutionStrategy) -> str:
    return type(strategy).__name__


def resolve_partition(trace: BlockTrace, strategy: ExecutionStrategy, config: RuntimeConfig,
                      training: bool, num_microbatches: int) -> Partition:
    """Apply ``strategy`` to the traced blocks and enforce the rules (module docstring);
    ``config``: the compiled model's options (pipeline depth against g / d)."""
    _check_begin_block_order(trace)
    if is_phased(strategy):
        stages, block_stage, num_phases = _phased_stages(trace, strategy)
    else:
        stages, block_stage = _pipeline_stages(trace, strategy)
        num_phases = 0
    weight_stage = _check_weights(trace, stages, block_stage)
    num_ipus = max(s.ipu for s in stages) + 1
    part = Partition(strategy, stages, block_stage, list(trace.sequence), num_ipus,
                     weight_stage, num_phases)
    if is_pipelined(part):
        _check_pipeline_depth(part, config, training)
    return part


def _check_begin_block_order(trace: BlockTrace) -> None:
    hooks = trace.begin_block_layers
    for earlier, later in itertools.pairwise(hooks):
        if later.order < earlier.order:
            raise Error(
                f"BeginBlock order: layer {earlier.layer_name} (block "
                f"{_label(earlier.user_id, earlier.ipu_id)}) runs before layer "
                f"{later.layer_name} (block {_label(later.user_id, later.ipu_id)}), but its "
                "BeginBlock was written after. Write the BeginBlock annotations in the order "
                "the layers run.")


def _label(user_id: str | int | None, ipu_id: int | None) -> str:
    return f"user_id={user_id!r}, ipu_id={ipu_id!r}"


def _pipeline_stages(trace: BlockTrace, strategy: ExecutionStrategy
                     ) -> tuple[list[StagePlan], dict[str, int]]:
    name = _kind(strategy)
    blocks = list(dict.fromkeys(trace.sequence))
    stage_key: dict[str, int] = {}
    ipu_of_key: dict[int, int] = {}
    if strategy.auto_stage is not None:
        next_stage = 0
        for block in blocks:
            ipu = trace.ipu_of.get(block)
            if strategy.auto_stage == AutoStage.SameAsIpu:
                if ipu is None:
                    raise Error(
                        f"Block {block!r} has no ipu_id, but {name} uses "
                        "AutoStage.SameAsIpu (stage id = ipu_id): give every block an "
                        "ipu_id, or list the stages explicitly, e.g. "
                        f"{name}(poptorch.Stage('A'), poptorch.Stage('B')).")
                stage_key[block] = ipu
                ipu_of_key[ipu] = ipu
            else:
                stage_key[block] = next_stage
                ipu_of_key[next_stage] = next_stage if ipu is None else ipu
                next_stage += 1
    else:
        explicit = strategy._explicit_stages()
        implicit = IMPLICIT_BLOCK in blocks
        for i, stage in enumerate(explicit):
            ipus: set = {trace.ipu_of.get(b) for b in stage.blocks} - {None}
            if stage._ipu is None and len(ipus) > 1:
                raise Error(f"{stage!r} of {name} has blocks on different IPUs {sorted(ipus)}: "
                            "a stage runs on one IPU. Set it with Stage(...).ipu(n).")
            ipu_of_key[i] = (stage._ipu if stage._ipu is not None else
                             (ipus.pop() if ipus else i))
            for block in stage.blocks:
                if block not in blocks:
                    raise Error(f"{stage!r} of {name} names block {block!r}, which the model "
                                f"never entered (blocks entered: {_user_blocks(blocks)}). "
                                "Remove it or fix its user_id.")
                stage_key[block] = i
        for block in blocks:
            if block not in stage_key and block != IMPLICIT_BLOCK:
                raise Error(f"Block {block!r} is not in any Stage of {name}: add it to one, "
                            f"e.g. poptorch.Stage({block!r}).")
        if implicit:  # code before the first block joins the first block's stage
            first = next((b for b in trace.sequence if b != IMPLICIT_BLOCK), None)
            stage_key[IMPLICIT_BLOCK] = stage_key[first] if first is not None else 0
            ipu_of_key.setdefault(0, 0)
    if kind_of(strategy) == PIPELINED:
        _check_ascending(trace.sequence, stage_key, name)
    keys = sorted(set(stage_key.values()))
    index_of = {k: i for i, k in enumerate(keys)}
    stages = [StagePlan(i, ipu_of_key[k], [b for b in blocks if stage_key[b] == k])
              for i, k in enumerate(keys)]
    return stages, {b: index_of[k] for b, k in stage_key.items()}


def _user_blocks(blocks: list[str]) -> list[str]:
    return [b for b in blocks if b != IMPLICIT_BLOCK]


def _check_ascending(sequence: list[str], stage_key: dict[str, int], name: str) -> None:
    for before, after in itertools.pairwise(sequence):
        if stage_key[after] < stage_key[before]:
            raise Error(
                f"Block {after!r} (stage {stage_key[after]}) runs after block {before!r} "
                f"(stage {stage_key[before]}): in {name} stage ids must ascend in the order "
                "the blocks run. Use poptorch.AutoStage.AutoIncrement, or assign the stages "
                "explicitly with poptorch.Stage.")


def _phased_stages(trace: BlockTrace, strategy: ExecutionStrategy
                   ) -> tuple[list[StagePlan], dict[str, int], int]:
    name = _kind(strategy)
    phases = strategy.phases
    if not phases:
        raise Error(f"{name} needs at least one poptorch.Phase.")
    blocks = list(dict.fromkeys(trace.sequence))
    stages: list[StagePlan] = []
    block_stage: dict[str, int] = {}
    group = len(phases[0].stages)
    # Automatic IPUs (stage j of phase p on IPU 2j + p % 2, or j) need phases of equal
    # width; stages placed explicitly with .ipu(n) may differ per phase, as upstream.
    automatic = any(stage._ipu is None for phase in phases for stage in phase.stages)
    for p, phase in enumerate(phases):
        if automatic and len(phase.stages) != group:
            raise Error(f"Phase {p} of {name} has {len(phase.stages)} stage(s) but phase 0 has "
                        f"{group}: the number of stages in each phase must match the number "
                        "of IPUs in each group of IPUs.")
        used: dict = {}
        for j, stage in enumerate(phase.stages):
            if stage._ipu is not None:
                ipu = stage._ipu
            elif kind_of(strategy) == PARALLEL_PHASED:
                ipu = 2 * j + p % 2
            else:
                ipu = j
            if kind_of(strategy) == PARALLEL_PHASED and ipu % 2 != p % 2:
                raise Error(f"{stage!r} of phase {p} is on IPU {ipu}: in {name} even phases "
                            "must run on even IPUs and odd phases on odd IPUs.")
            if ipu in used:
                raise Error(f"{stage!r} and {used[ipu]!r} of phase {p} are both on IPU {ipu}: "
                            "the stages of a phase run in parallel, one per IPU.")
            used[ipu] = stage
            index = len(stages)
            stages.append(StagePlan(index, ipu, list(stage.blocks), phase=p))
            for block in stage.blocks:
                if block not in blocks:
                    raise Error(f"{stage!r} of phase {p} names block {block!r}, which the "
                                f"model never entered (blocks entered: {_user_blocks(blocks)}).")
                block_stage[block] = index
    for block in blocks:
        if block not in block_stage and block != IMPLICIT_BLOCK:
            raise Error(f"Block {block!r} is not in any Phase of {name}: add a "
                        f"poptorch.Stage({block!r}) to one of its phases.")
    if IMPLICIT_BLOCK in blocks:
        first = next((b for b in trace.sequence if b != IMPLICIT_BLOCK), None)
        block_stage[IMPLICIT_BLOCK] = block_stage[first] if first is not None else 0
    for before, after in zip(trace.sequence, trace.sequence[1:], strict=False):
        # (phased partitions give every stage its phase)
        pb, pa = stages[block_stage[before]].phase or 0, stages[block_stage[after]].phase or 0
        if pa < pb:
            raise Error(f"Block {after!r} (phase {pa}) runs after block {before!r} (phase "
                        f"{pb}): in {name} phases run one after another, so the blocks of a "
                        "phase must run after those of every earlier phase.")
    return stages, block_stage, len(phases)


def _check_weights(trace: BlockTrace, stages: list[StagePlan],
                   block_stage: dict[str, int]) -> dict[int, int]:
    weight_stage: dict[int, int] = {}
    for key, users in trace.users.items():
        stage_ids = [block_stage[b] for b in users]
        ipus = {stages[s].ipu for s in stage_ids}
        if len(ipus) > 1:
            raise Error(f"Weight {trace.tensor_names[key]!r} is shared by blocks {users} on "
                        f"IPUs {sorted(ipus)}: layers that share weights must be on the same "
                        "IPU. Put those blocks on one IPU.")
        weight_stage[key] = stage_ids[0]
    return weight_stage


def is_pipelined(part: Partition) -> bool:
    """Whether ``part`` runs as a pipeline. As upstream, ``PipelinedExecution`` pipelines
    only a model that spans more than one IPU; stages that all sit on one IPU run one after
    the other within each micro-batch (no pipeline depth to fill)."""
    return kind_of(part.strategy) == PIPELINED and part.num_stages > 1 and part.num_ipus > 1


def _check_pipeline_depth(part: Partition, config: RuntimeConfig, training: bool) -> None:
    n = part.num_stages
    if training:
        g = config.training.gradient_accumulation
        needed = 2 * n - 1
        if g < needed:
            raise Error(
                f"poptorch.Options().Training.gradientAccumulation must be greater than or "
                f"equal to the number of pipeline stages ({needed}) when using "
                f"poptorch.PipelinedExecution. Please note that a model with {n} pipeline "
                f"stages in PopTorch will have an additional {n - 1} stages when training. "
                f"It is {g}: increase it, or use poptorch.ShardedExecution.")
    else:
        d = config.device_iterations
        if d < n:
            raise Error(
                f"poptorch.Options().deviceIterations must be greater than or equal to the "
                f"number of pipeline stages ({n}) for inference with "
                f"poptorch.PipelinedExecution. It is {d}: increase it, or use "
                "poptorch.ShardedExecution.")


__all__ = [
    "IMPLICIT_BLOCK",
    "BlockNamer",
    "BlockTrace",
    "Partition",
    "StagePlan",
    "has_static_annotations",
    "is_pipelined",
    "resolve_partition",
    "trace_blocks",
]
