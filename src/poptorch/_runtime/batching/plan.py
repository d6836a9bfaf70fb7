"""Batching of one call of a wrapped model, and the output modes.

An input's dimension 0 holds ``d * g * r * m`` rows (device iterations, gradient
accumulation, replicas, micro-batch), read as ``[d][g][r][m]``: device iteration ``i``
takes the ``i``-th contiguous ``1/d`` of the rows, accumulation step ``j`` the ``j``-th
``1/g`` of that, replica ``k`` the ``k``-th ``1/r`` of that.

With ``Options.inputReplicaGrouping(G, type)`` the replicas of one input group receive
the same micro-batch, so an input holds ``d * g * (r/G) * m`` rows read as
``[d][g][r/G][m]``. Replica ``k`` reads input slot ``k // G`` (``Consecutive``: groups
``[0..G-1], [G..2G-1], ...``) or ``k % (r/G)`` (``Orthogonal``: groups
``{j, j + r/G, j + 2r/G, ...}``). Runners still see ``g * r`` micro-batches per step.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch

from ..._typing import UserOutput
from ...enums import CommGroupType, OutputMode
from ...errors import Error, PoptorchAssertionError, PoptorchValueError
from ..torch_internals import pytree
from .structures import register_mapping_outputs

Microbatch = tuple[tuple, dict]


@dataclass(frozen=True)
class BatchPlan:
    """The factors that shape one call: d, g, r, and the input replica grouping."""
    device_iterations: int
    gradient_accumulation: int
    replication_factor: int
    input_group_size: int = 1
    input_group_type: CommGroupType = CommGroupType.Consecutive

    def __post_init__(self) -> None:
        r, size = self.replication_factor, self.input_group_size
        if size < 1 or r % size:  # upstream: the setter's ValueError
            raise PoptorchValueError(
                f"inputReplicaGrouping: input_group_size ({size}) must divide "
                f"replicationFactor ({r}): choose a group size among "
                f"{[n for n in range(1, r + 1) if r % n == 0]}.")
        if self.input_group_type == CommGroupType.NoGrouping or r == 1:
            object.__setattr__(self, "input_group_size", 1)  # every replica alone

    @property
    def input_slots(self) -> int:
        """Distinct inputs per accumulation step: r / input_group_size."""
        return self.replication_factor // self.input_group_size

    @property
    def input_factor(self) -> int:
        """Micro-batches an input holds per call: d * g * r / input_group_size."""
        return self.device_iterations * self.gradient_accumulation * self.input_slots

    def input_slot(self, replica: int) -> int:
        """Which of the ``input_slots`` inputs of an accumulation step ``replica`` reads."""
        if self.input_group_type == CommGroupType.Orthogonal:
            return replica % self.input_slots
        return replica // self.input_group_size

    @property
    def per_step(self) -> int:
        """Micro-batches per optimizer step (or per inference iteration): g * r."""
        return self.gradient_accumulation * self.replication_factor

    @property
    def factor(self) -> int:
        """Micro-batches per call: d * g * r."""
        return self.device_iterations * self.per_step


def _size_error(plan: BatchPlan, where: str, rows: int) -> PoptorchAssertionError:
    """The refusal of a batch that does not fit the options: an ``AssertionError``, as
    upstream's ``_narrow_tensor`` raised, that is also a ``poptorch.Error``."""
    f = plan.input_factor
    lower = (rows // f) * f
    suggestion = f"{lower} or {lower + f}" if lower else f"{f} (or a multiple of it)"
    replicas = f"replicationFactor ({plan.replication_factor})"
    if plan.input_group_size > 1:
        replicas = (f"(replicationFactor ({plan.replication_factor}) / "
                    f"inputReplicaGrouping size ({plan.input_group_size}))")
    return PoptorchAssertionError(
        f"Input {where} has batch size {rows}, which is not a multiple of "
        f"deviceIterations ({plan.device_iterations}) x {replicas} x gradientAccumulation "
        f"({plan.gradient_accumulation}) = {f}. Each call consumes {f} micro-batches: "
        f"pass a batch of {suggestion} rows (micro-batch size x {f}), or change the "
        "options. poptorch.DataLoader builds batches of the right size.")


def split_inputs(plan: BatchPlan, args: tuple, kwargs: dict) -> list[list[Microbatch]]:
    """Split the inputs of one call into ``[d][g*r]`` micro-batches.

    Every tensor of dimension >= 1 is split along dimension 0; other leaves (None,
    numbers, 0-dim tensors) are given unchanged to every micro-batch. Raises
    :py:class:`poptorch.Error` before anything runs when a batch size does not fit.
    """
    if plan.factor == 1:
        return [[(args, kwargs)]]
    if plan.input_group_size == 1 and not kwargs and all(
            isinstance(a, torch.Tensor) and a.dim() > 0 for a in args):
        micro = _split_plain(plan, args)
    else:
        micro = _split_tree(plan, args, kwargs)
    if plan.input_group_size > 1:
        return _regroup(plan, micro)
    per_step = plan.per_step
    return [micro[i * per_step:(i + 1) * per_step] for i in range(plan.device_iterations)]


def _split_tree(plan: BatchPlan, args: tuple, kwargs: dict) -> list[Microbatch]:
    """The ``input_factor`` micro-batches of any input structure, in input order."""
    f = plan.input_factor
    leaves, spec = pytree.tree_flatten((args, kwargs))
    chunks: list[tuple[torch.Tensor, ...] | None] = []
    for index, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            rows = leaf.shape[0]
            if rows % f or rows == 0:
                raise _size_error(plan, _describe_leaf(spec, index), rows)
            chunks.append(leaf.split(rows // f))
        else:
            chunks.append(None)
    return [pytree.tree_unflatten([leaf if c is None else c[n]
                                   for leaf, c in zip(leaves, chunks, strict=False)], spec)
            for n in range(f)]


def _split_plain(plan: BatchPlan, args: tuple) -> list[Microbatch]:
    """Fast path of :py:func:`_split_tree` for positional tensor arguments only."""
    f = plan.input_factor
    chunks = []
    for index, arg in enumerate(args):
        rows = arg.shape[0]
        if rows % f or rows == 0:
            raise _size_error(plan, f"args[{index}]", rows)
        chunks.append(arg.split(rows // f))
    empty: dict = {}
    return [(args, empty) for args in zip(*chunks, strict=True)]


def _regroup(plan: BatchPlan, micro: list[Microbatch]) -> list[list[Microbatch]]:
    """Give each replica the input of its group (input replica grouping, see module
    docstring): ``[d * g * r/G]`` distinct micro-batches -> ``[d][g * r]``."""
    slots = [plan.input_slot(k) for k in range(plan.replication_factor)]
    n, g = plan.input_slots, plan.gradient_accumulation
    return [[micro[(i * g + j) * n + s] for j in range(g) for s in slots]
            for i in range(plan.device_iterations)]


def _describe_leaf(spec: pytree.TreeSpec, index: int) -> str:
    """A readable name of the ``index``-th leaf, e.g. ``args[0]`` or ``kwargs['x']``."""
    paths = [p for p, _ in pytree.tree_flatten_with_path(
        pytree.tree_unflatten([0] * spec.num_leaves, spec))[0]]
    path = paths[index]
    first = cast(pytree.SequenceKey, path[0])  # the key of args / kwargs in (args, kwargs)
    head = "args" if first.idx == 0 else "kwargs"
    return head + "".join(str(k) for k in path[1:])


def resolve_output_mode(mode: int, training: bool) -> OutputMode:
    """``Default`` means ``Final`` for training models and ``All`` for inference."""
    mode = OutputMode(mode)
    if mode == OutputMode.Default:
        return OutputMode.Final if training else OutputMode.All
    return mode


class OutputCollector:
    """Keeps the micro-batch outputs an output mode needs, and combines them.

    Outputs arrive as ``add(i, n, output)`` for device iteration ``i`` and micro-batch
    ``n`` (0 <= n < g*r, accumulation-major). Only what the mode returns is kept.
    """

    def __init__(self, plan: BatchPlan, mode: OutputMode, period: int) -> None:
        self.plan = plan
        self.mode = mode
        self.period = period
        d = plan.device_iterations
        if mode == OutputMode.EveryN and (period < 1 or d % period):
            raise Error(
                f"OutputMode.EveryN with output_return_period={period} needs "
                f"deviceIterations ({d}) to be a multiple of the period: choose a period "
                f"that divides {d}.")
        self._kept: list[UserOutput] = []
        self._sums: list[UserOutput] | None = None
        r = plan.replication_factor
        self._last_acc_start = plan.per_step - r  # first micro-batch of the last acc step

    def wants(self, i: int, n: int) -> bool:
        """Whether the output of device iteration ``i``, micro-batch ``n`` is needed."""
        mode = self.mode
        if mode in (OutputMode.All, OutputMode.Sum):
            return True
        if n < self._last_acc_start:
            return False
        if mode == OutputMode.Final:
            return i == self.plan.device_iterations - 1
        return (i + 1) % self.period == 0  # EveryN

    @property
    def keeps_all(self) -> bool:
        """Whether every micro-batch output is kept as it is (``All``)."""
        return self.mode == OutputMode.All

    def extend(self, outputs: list) -> None:
        """Record the (detached) outputs of a whole iteration (``keeps_all`` only)."""
        self._kept.extend(outputs)

    def add(self, n: int, output: UserOutput) -> None:
        """Record a wanted micro-batch output (already detached)."""
        if self.mode != OutputMode.Sum:
            self._kept.append(output)
            return
        replica = n % self.plan.replication_factor
        if self._sums is None:
            self._sums = [None] * self.plan.replication_factor
        prev = self._sums[replica]
        self._sums[replica] = output if prev is None else pytree.tree_map(
            _add_leaf, prev, output)

    def result(self) -> UserOutput:
        """The combined outputs: one micro-batch's output is returned unchanged;
        several are concatenated along dimension 0 (scalars are stacked)."""
        parts: list[UserOutput] = self._kept if self.mode != OutputMode.Sum else (self._sums or [])
        if len(parts) == 1:
            return parts[0]
        first = parts[0]
        if type(first) is tuple:  # (tested first: see _tensor_columns)
            columns = _tensor_columns(parts, len(first))
            if columns is not None:
                return tuple([_combine(column) for column in columns])
        elif isinstance(first, torch.Tensor):
            for part in parts:
                if not isinstance(part, torch.Tensor):
                    break
            else:
                return _combine(parts)
        register_mapping_outputs(first)  # dict-like outputs: combined key by key
        flat = [pytree.tree_flatten(p) for p in parts]
        spec = flat[0][1]
        combined = [_combine([f[0][k] for f in flat]) for k in range(len(flat[0][0]))]
        return pytree.tree_unflatten(combined, spec)


def _tensor_columns(parts: list, width: int) -> list[list[torch.Tensor]] | None:
    """The columns of ``parts`` when each is a plain tuple of ``width`` tensors (the
    common outputs), else None. Plain loops: a generator per test costs more than the
    test, and ``isinstance`` of a non-tensor against ``torch.Tensor`` takes its
    metaclass's slow path, so the tuple's type is tested first."""
    for part in parts:
        if type(part) is not tuple or len(part) != width:
            return None
    columns = [list(column) for column in zip(*parts, strict=True)]
    for column in columns:
        for t in column:
            if not isinstance(t, torch.Tensor):
                return None
    return columns


def _add_leaf(a: UserOutput, b: UserOutput) -> UserOutput:
    return a + b if isinstance(a, torch.Tensor) else b


def _combine(values: list) -> object:
    first = values[0]
    if not isinstance(first, torch.Tensor):
        return values[-1]
    if first.dim() == 0:
        return torch.stack(values)
    return torch.cat(values)
