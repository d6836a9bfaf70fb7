"""Replica-grouped weights (``Parameter.replicaGrouping``): groups of replicas that each
hold their own value of a weight.

A grouped parameter's host tensor has one slice per group along its first dimension
(``[groups, *shape]``; ``VariableRetrievalMode.OnePerGroup``). While replica ``k``'s
micro-batch runs, the parameter *is* its group's slice (its ``.data`` is swapped to a
view), so the model sees ``shape``. Each micro-batch's gradient is added into its
group's slice of a full-size gradient, so the gradient of group ``g`` is the sum over
the replicas of group ``g`` only; the device program then applies the step's Mean / Sum
over all replicas, as for any weight (the rule of the user guide's example: the loss
of the whole problem is the mean of the replicas' losses). Across processes the full
gradient is summed over the processes: a group's slice only gets contributions from the
processes whose replicas belong to it.

Group of global replica ``k`` of ``R`` with group size ``s``: ``Consecutive``
``k // s`` (``R / s`` groups), ``Orthogonal`` ``k % (R / s)``, ``NoGrouping`` ``k``
(``R`` groups), ``All`` no grouping.
"""
from __future__ import annotations

from typing import List

import torch

from ...enums import CommGroupType, VariableRetrievalMode
from ...errors import Error


def group_of(replica: int, replicas: int, kind: CommGroupType, size: int) -> int:
    """The group index of global replica ``replica`` (see module docstring)."""
    if kind == CommGroupType.Consecutive:
        return replica // size
    if kind == CommGroupType.Orthogonal:
        return replica % (replicas // size)
    return replica  # NoGrouping


def group_count(replicas: int, kind: CommGroupType, size: int) -> int:
    """How many groups ``replicas`` replicas form."""
    return replicas if kind == CommGroupType.NoGrouping else replicas // size


class GroupedParameter:
    """The per-replica side of one replica-grouped parameter (a ReplicaState)."""

    def __init__(self, name: str, param: torch.nn.Parameter, kind: CommGroupType,
                 size: int, mode: VariableRetrievalMode, first_replica: int,
                 local_replicas: int, replicas: int) -> None:
        kind, mode = CommGroupType(kind), VariableRetrievalMode(mode)
        if mode != VariableRetrievalMode.OnePerGroup:
            raise Error(f"{name}.replicaGrouping: VariableRetrievalMode.{mode.name} would "
                        "return one value per replica; here the weight reads back one "
                        "value per group: use VariableRetrievalMode.OnePerGroup.")
        if kind != CommGroupType.NoGrouping and (size < 1 or replicas % size):
            raise Error(f"{name}.replicaGrouping: a group size of {size} does not divide "
                        f"the {replicas} replicas of this run.")
        count = group_count(replicas, kind, size)
        if param.dim() == 0 or param.shape[0] != count:
            raise Error(f"{name}.replicaGrouping({kind.name}, {size}): {replicas} replicas "
                        f"form {count} groups, so the weight needs a first dimension of "
                        f"{count} (one slice per group), but its shape is "
                        f"{tuple(param.shape)}.")
        self.param = param
        self.full = param.data
        self.groups = [group_of(first_replica + j, replicas, kind, size)
                       for j in range(local_replicas)]
        self.grad: torch.Tensor | None = None
        self.current = -1

    def select(self, replica: int) -> None:
        group = self.groups[replica]
        if group != self.current:
            self.param.data = self.full[group]
            self.current = group

    def after_microbatch(self, replica: int, training: bool) -> None:
        grad = self.param.grad
        if not training or grad is None:
            return
        if self.grad is None:
            self.grad = torch.zeros_like(self.full)
        self.grad[self.groups[replica]] += grad
        self.param.grad = None

    def end_step(self) -> None:
        return None

    def restore(self, training: bool) -> None:
        self.param.data = self.full
        self.current = -1
        if training:
            self.param.grad, self.grad = self.grad, None


def grouped_parameters(model: torch.nn.Module, groupings: dict, first_replica: int,
                       local_replicas: int, replicas: int) -> List[GroupedParameter]:
    """The grouped parameters of ``model`` from ``{name: (kind, size, mode)}``
    (``CommGroupType.All`` entries are plain weights)."""
    params = dict(model.named_parameters())
    result = []
    for name, (kind, size, mode) in groupings.items():
        if CommGroupType(kind) == CommGroupType.All:
            continue
        result.append(GroupedParameter(name, params[name], kind, size, mode,
                                       first_replica, local_replicas, replicas))
    return result
