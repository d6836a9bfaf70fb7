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
        if kind != CommGroupType.NoGrouping and (size < 1 or replicas % size):
            raise Error(f"{name}.replicaGrouping: a group size of {size} does not divide "
                        f"the {replicas} replicas of this run.")
        groups = group_count(replicas, kind, size)
        per_replica = mode == VariableRetrievalMode.AllReplicas
        count, unit = (replicas, "replica") if per_replica else (groups, "group")
        if param.dim() == 0 or param.shape[0] != count:
            raise Error(f"{name}.replicaGrouping({kind.name}, {size}, {mode.name}): "
                        f"{replicas} replicas form {groups} groups, so the weight needs a "
                        f"first dimension of {count} (one slice per {unit}), but its shape "
                        f"is {tuple(param.shape)}.")
        self.name = name
        self.param = param
        self.full = param.data
        local = range(first_replica, first_replica + local_replicas)
        self.groups = [group_of(k, replicas, kind, size) for k in local]
        # The slice of the host tensor each local replica runs with: its group's, or
        # (AllReplicas) its own; the replicas of a group get the same updates.
        self.slots = list(local) if per_replica else self.groups
        self.group_count = groups
        self.slot_groups = (torch.tensor([group_of(k, replicas, kind, size)
                                          for k in range(replicas)])
                            if per_replica else None)
        self.grad: torch.Tensor | None = None
        self.current = -1

    def select(self, replica: int) -> None:
        slot = self.slots[replica]
        if slot != self.current:
            self.param.data = self.full[slot]
            self.current = slot

    def after_microbatch(self, replica: int, training: bool) -> None:
        grad = self.param.grad
        if not training or grad is None:
            return
        if self.grad is None:
            self.grad = grad.new_zeros((self.group_count, *grad.shape))
        self.grad[self.groups[replica]] += grad
        self.param.grad = None

    def end_step(self) -> None:
        return None

    def restore(self, training: bool) -> None:
        self.param.data = self.full
        self.current = -1
        if training:
            grad, self.grad = self.grad, None
            if grad is not None and self.slot_groups is not None:
                # Every replica's slice gets its group's gradient (also the slices of
                # other processes' replicas: summed over processes, each slice then
                # holds its whole group's gradient).
                grad = grad.index_select(0, self.slot_groups.to(grad.device))
            self.param.grad = grad


def grouped_parameters(model: torch.nn.Module, groupings: dict, first_replica: int,
                       local_replicas: int, replicas: int) -> list[GroupedParameter]:
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
