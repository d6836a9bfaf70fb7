"""``poptorch_model.weight.replicaGrouping(...)``: replica-grouped weights.

As upstream, a parameter read as an attribute of a PopTorch model
(``poptorch_model.W``) comes wrapped so that ``replicaGrouping`` can be called on it; the
grouping belongs to that wrapper (the same module may be wrapped for training and for
inference). Every other attribute is the parameter's. The engine side is
``poptorch._runtime.program.replica_groups``.
"""
from __future__ import annotations

from typing import Any, Protocol

import torch

from ..enums import CommGroupType, VariableRetrievalMode
from ..errors import Error
from ..options.store import check_enum, check_int


class CompiledOrNot(Protocol):
    """The PopTorch model a parameter is seen through (``PoplarExecutor``)."""

    def isCompiled(self) -> bool: ...


class GroupableParameter:
    """A model parameter seen through a PopTorch model: ``replicaGrouping`` plus every
    attribute of the parameter itself."""

    def __init__(self, executor: CompiledOrNot, groupings: dict, name: str,
                 param: torch.nn.Parameter) -> None:
        object.__setattr__(self, "_executor", executor)
        object.__setattr__(self, "_groupings", groupings)  # the executor's, by name
        object.__setattr__(self, "_name", name)
        object.__setattr__(self, "_param", param)

    def replicaGrouping(self, comm_group_type: CommGroupType, shards: int,
                        variable_retrieval_mode: VariableRetrievalMode) -> None:
        """Give each group of replicas its own value of this weight: the weight's first
        dimension indexes the groups (see the user guide, "Grouping tensor weights
        across replicas"). ``shards`` is the number of replicas in a group
        (ignored for ``NoGrouping``). Call it before the model first runs."""
        what = f"{self._name}.replicaGrouping"
        kind = check_enum(f"{what} comm_group_type", comm_group_type, CommGroupType)
        size = check_int(f"{what} shards", shards, minimum=0)
        mode = check_enum(f"{what} variable_retrieval_mode", variable_retrieval_mode,
                          VariableRetrievalMode)
        executor = self._executor
        if executor.isCompiled():
            raise Error(f"{what} must be called before the model is first run (or "
                        "compiled): the grouping is part of the compiled program.")
        self._groupings[self._name] = (kind, size, mode)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._param, name)

    def __setattr__(self, name: str, value: object) -> None:
        setattr(self._param, name, value)

    def __repr__(self) -> str:
        return repr(self._param)
