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
from .strategy import PARALLEL_PHASED, PIPELINED, ExecutionStrategy, is_phased

IMPLICIT_BLOCK = "<before first block>"


@dataclass
class BlockTrace:
    """What one traced forward pass showed."""
    sequence: list[str] = field(default_factory=list)  # block ids, in the order entered
    ipu_of: dict[str, int | None] = field(default_factory=dict)
    users: dict[int, list[str]] = field(default_factory=dict)  # id(param/buffer) -> blocks
    tensor_names: dict[int, str] = field(default_factory=dict)
    begin_block_layers: list[markers.BeginBlockHook] = field(default_factory=list)  # in call order

    def enter_implicit(self) -> str:
        """Put the implicit block (code before the first block, on IPU 0) first in the
        sequence; returns its id."""
        self.sequence.insert(0, IMPLICIT_BLOCK)
        self.ipu_of[IMPLICIT_BLOCK] = 0
        return IMPLICIT_BLOCK


class BlockRecorder(markers.BlockListener):
    """Base of the listeners tracing a model (this module's, both captures'): records the
    blocks entered in ``block_trace`` and enforces the rule on their IPUs. Cooperative
    (``super().__init__()``), to be mixed with a torch function mode or an fx tracer."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.block_trace = BlockTrace()
        self.current: str | None = None
        self.checkpoints = 0  # recomputation checkpoints recorded (by the captures)
        names = self.block_trace.tensor_names
        names.update({id(t): n for n, t in model.named_parameters()})
        names.update({id(t): n for n, t in model.named_buffers()})

    def begin_block(self, user_id: markers.BlockId, ipu_id: int | None,
                    layer: torch.nn.Module | None = None) -> None:
        block, trace = self.block_id(user_id), self.block_trace
        known = trace.ipu_of.get(block, ipu_id)
        if block in trace.ipu_of and ipu_id is not None and known != ipu_id:
            raise Error(f"Block {block!r} is placed on IPU {known} and on IPU {ipu_id}: "
                        "blocks with the same user_id are one block and run on one IPU.")
        trace.ipu_of[block] = ipu_id if known is None else known
        if layer is not None:
            hook = markers.begin_block_of(layer)
            if hook is not None and hook not in trace.begin_block_layers:
                trace.begin_block_layers.append(hook)
        if not trace.sequence or trace.sequence[-1] != block:
            trace.sequence.append(block)
        self.current = block

    def block_now(self) -> str:
        """The current block; before the first one, the implicit block (entered now)."""
        if self.current is None:
            self.current = self.block_trace.enter_implicit()
        return self.current


class _Tracer(BlockRecorder, TorchFunctionMode):
    """Block recorder + torch function mode recording which block uses which weight."""

    def __torch_function__(self, func: Callable[..., object], types: Collection[type],
                           args: tuple[object, ...] = (),
                           kwargs: dict[str, object] | None = None) -> object:
        kwargs = kwargs or {}
        block = self.block_now()
        for t in pytree.tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor) and id(t) in self.block_trace.tensor_names:
                users = self.block_trace.users.setdefault(id(t), [])
                if block not in users:
                    users.append(block)
        return func(*args, **kwargs)


def has_static_annotations(model: torch.nn.Module) -> bool:
    """True when BeginBlock / LegacyBeginBlockFn / IPU annotations are visible in the
    module tree (Block and BlockFunction only show when forward runs)."""
    return any(markers.starts_block(m) for m in model.modules())


def trace_blocks(model: torch.nn.Module, args: tuple, kwargs: dict,
                 strategy: ExecutionStrategy) -> BlockTrace:
    """Run ``model`` once without side effects and record its blocks (module docstring)."""
    tracer = _Tracer(model)
    saved_buffers = [(b, b.detach().clone()) for b in model.buffers()]
    cuda = [torch.cuda.current_device()] if torch.cuda.is_initialized() else []
    strategy.onStartTracing()
    try:
        with markers.listening(tracer), torch.no_grad(), \
                torch.random.fork_rng(devices=cuda), context.running_on_ipu(), tracer:
            model(*args, **kwargs)
    finally:
        strategy.onEndTracing()
        context.take_marked_losses()
        with torch.no_grad():
            for buffer, value in saved_buffers:
                buffer.copy_(value)
    return tracer.block_trace


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


def resolve_partition(trace: BlockTrace, strategy: ExecutionStrategy, config: RuntimeConfig,
                      training: bool) -> Partition:
    """Apply ``strategy`` to the traced blocks and enforce the rules (module docstring);
    ``config``: the compiled model's options (pipeline depth against g / d)."""
    _check_begin_block_order(trace)
    stages_of = _phased_stages if is_phased(strategy) else _pipeline_stages
    stages, block_stage, num_phases = stages_of(trace, strategy, type(strategy).__name__,
                                                list(dict.fromkeys(trace.sequence)))
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


def _pipeline_stages(trace: BlockTrace, strategy: ExecutionStrategy, name: str,
                     blocks: list[str]) -> tuple[list[StagePlan], dict[str, int], int]:
    """The stages of a pipelined or sharded ``strategy`` (``name``) over the ``blocks``
    entered (no phases)."""
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
        for i, stage in enumerate(strategy._explicit_stages()):
            ipus: set = {trace.ipu_of.get(b) for b in stage.blocks} - {None}
            if stage._ipu is None and len(ipus) > 1:
                raise Error(f"{stage!r} of {name} has blocks on different IPUs {sorted(ipus)}: "
                            "a stage runs on one IPU. Set it with Stage(...).ipu(n).")
            ipu_of_key[i] = (stage._ipu if stage._ipu is not None else
                             (ipus.pop() if ipus else i))
            _check_entered(f"{stage!r} of {name}", stage.blocks, blocks,
                           " Remove it or fix its user_id.")
            stage_key.update(dict.fromkeys(stage.blocks, i))
        if (missing := _unplaced(blocks, stage_key)) is not None:
            raise Error(f"Block {missing!r} is not in any Stage of {name}: add it to one, "
                        f"e.g. poptorch.Stage({missing!r}).")
        if _place_implicit(trace.sequence, stage_key):
            ipu_of_key.setdefault(0, 0)
    if strategy.schedule_kind == PIPELINED and (
            pair := _descent(trace.sequence, stage_key.__getitem__)) is not None:
        before, after = pair
        raise Error(
            f"Block {after!r} (stage {stage_key[after]}) runs after block {before!r} "
            f"(stage {stage_key[before]}): in {name} stage ids must ascend in the order "
            "the blocks run. Use poptorch.AutoStage.AutoIncrement, or assign the stages "
            "explicitly with poptorch.Stage.")
    keys = sorted(set(stage_key.values()))
    index_of = {k: i for i, k in enumerate(keys)}
    stages = [StagePlan(i, ipu_of_key[k], [b for b in blocks if stage_key[b] == k])
              for i, k in enumerate(keys)]
    return stages, {b: index_of[k] for b, k in stage_key.items()}, 0


def _check_entered(stage: str, named: list[str], blocks: list[str], advice: str = "") -> None:
    """Refuse a block that ``stage`` (as the message names it) lists, ``named``, but
    that is not among the ``blocks`` the model entered."""
    for block in named:
        if block not in blocks:
            user_blocks = [b for b in blocks if b != IMPLICIT_BLOCK]
            raise Error(f"{stage} names block {block!r}, which the model never "
                        f"entered (blocks entered: {user_blocks}).{advice}")


def _unplaced(blocks: list[str], placed: dict[str, int]) -> str | None:
    """The first user block of ``blocks`` that no stage holds (None: all placed)."""
    return next((b for b in blocks if b not in placed and b != IMPLICIT_BLOCK), None)


def _place_implicit(sequence: list[str], stage_of: dict[str, int]) -> bool:
    """Put the implicit block, if entered, in the first block's stage (stage 0 when it is
    the only block); whether it was entered."""
    if IMPLICIT_BLOCK not in sequence:
        return False
    first = next((b for b in sequence if b != IMPLICIT_BLOCK), None)
    stage_of[IMPLICIT_BLOCK] = stage_of[first] if first is not None else 0
    return True


def _descent(sequence: list[str], key: Callable[[str], int]) -> tuple[str, str] | None:
    """The first two consecutive blocks of ``sequence`` whose ``key`` goes down."""
    return next(((before, after) for before, after in itertools.pairwise(sequence)
                 if key(after) < key(before)), None)


def _phased_stages(trace: BlockTrace, strategy: ExecutionStrategy, name: str,
                   blocks: list[str]) -> tuple[list[StagePlan], dict[str, int], int]:
    """The stages of a phased ``strategy`` (``name``) over the ``blocks`` entered, and
    the number of phases."""
    phases = strategy.phases
    if not phases:
        raise Error(f"{name} needs at least one poptorch.Phase.")
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
            elif strategy.schedule_kind == PARALLEL_PHASED:
                ipu = 2 * j + p % 2
            else:
                ipu = j
            if strategy.schedule_kind == PARALLEL_PHASED and ipu % 2 != p % 2:
                raise Error(f"{stage!r} of phase {p} is on IPU {ipu}: in {name} even phases "
                            "must run on even IPUs and odd phases on odd IPUs.")
            if ipu in used:
                raise Error(f"{stage!r} and {used[ipu]!r} of phase {p} are both on IPU {ipu}: "
                            "the stages of a phase run in parallel, one per IPU.")
            used[ipu] = stage
            index = len(stages)
            stages.append(StagePlan(index, ipu, list(stage.blocks), phase=p))
            _check_entered(f"{stage!r} of phase {p}", stage.blocks, blocks)
            block_stage.update(dict.fromkeys(stage.blocks, index))
    if (missing := _unplaced(blocks, block_stage)) is not None:
        raise Error(f"Block {missing!r} is not in any Phase of {name}: add a "
                    f"poptorch.Stage({missing!r}) to one of its phases.")
    _place_implicit(trace.sequence, block_stage)

    def phase_of(block: str) -> int:  # (phased partitions give every stage its phase)
        return stages[block_stage[block]].phase or 0
    if (pair := _descent(trace.sequence, phase_of)) is not None:
        before, after = pair
        raise Error(f"Block {after!r} (phase {phase_of(after)}) runs after block {before!r} "
                    f"(phase {phase_of(before)}): in {name} phases run one after another, so "
                    "the blocks of a phase must run after those of every earlier phase.")
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
    return part.strategy.schedule_kind == PIPELINED and part.num_stages > 1 and part.num_ipus > 1


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


__all__ = ["IMPLICIT_BLOCK", "BlockRecorder", "BlockTrace", "Partition", "StagePlan",
           "has_static_annotations", "is_pipelined", "resolve_partition", "trace_blocks"]
