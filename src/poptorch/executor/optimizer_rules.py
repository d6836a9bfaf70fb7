"""PopTorch's rules linking a model's optimizer and options (checked when wrapping and
compiling).

* Mean reduction strategy: an optimizer accumulating gradients in float16
  (``accum_type=torch.float16``, not the combined SGD variant) uses
  ``MeanReductionStrategy.Running`` (each micro-batch loss is scaled by ``1/n`` before
  the backward pass, so the float16 sum cannot overflow); the model's copy of the
  options is switched to it when the model is compiled. Once compiled the strategy
  cannot change, so ``setOptimizer`` with such an optimizer on a model compiled with
  another strategy raises ``ValueError``.
* ``optimizer.state_dict()`` shows the device view (``ipu_state`` / ``ipu_param``, see
  ``optim/ipu_state.py``) once the model is compiled for a device (not for an offline
  target); a replica-grouped parameter's state has one value per group.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .._logging import logger
from .._runtime.attributes import own_attribute_names
from ..enums import MeanReductionStrategy
from ..errors import PoptorchValueError

if TYPE_CHECKING:
    from .._runtime.program.optimizer import AttributeKeys
    from ..options.options import Options


def _needs_running_mean(optimizer: object) -> bool:
    return getattr(optimizer, "accum_type", None) == torch.float16 and \
        not getattr(optimizer, "use_combined_accum", False)


def apply_mean_reduction_rule(options: Options, optimizer: object, compiled: bool) -> None:
    """See module docstring; ``options`` is the model's own (unfrozen before compile)."""
    if not _needs_running_mean(optimizer):
        return
    training = options.Training
    current = MeanReductionStrategy(training.meanAccumulationAndReplicationReductionStrategy)
    if current == MeanReductionStrategy.Running:
        return
    if compiled:
        raise PoptorchValueError(
            "Invalid optimizer: accum_type=torch.float16 needs options.Training."
            "meanAccumulationAndReplicationReductionStrategy to be "
            "poptorch.MeanReductionStrategy.Running, but the model is already compiled "
            f"with {current.name}. Create a new trainingModel with this optimizer.")
    training.setMeanAccumulationAndReplicationReductionStrategy(
        MeanReductionStrategy.Running)


def mark_compiled(optimizer: object, options: Options) -> None:
    """Let a poptorch.optim optimizer show its device view in ``state_dict()``."""
    if hasattr(optimizer, "_compiled_on_device") and not options.exists("ipu_version"):
        optimizer._compiled_on_device = True


def mark_grouped(optimizer: object, models: tuple[torch.nn.Module, ...],
                 groups: dict[str, int]) -> None:
    """Tell a poptorch.optim optimizer which of its parameters are replica-grouped
    (``{name: number of groups}``), so that its device view holds one value per group
    of every state tensor (``optim/ipu_state.py``), as PopTorch's does."""
    if not hasattr(optimizer, "_compiled_on_device"):
        return
    params = [p for group in getattr(optimizer, "param_groups", ())
              for p in group["params"]]
    index = {id(p): i for i, p in enumerate(params)}
    grouped: dict[int, int] = {}
    for model in models:
        named = dict(model.named_parameters())
        for name, count in groups.items():
            p = named.get(name)
            if p is not None and id(p) in index:
                grouped[index[id(p)]] = count
    setattr(optimizer, "_grouped_params", grouped)  # noqa: B010  # (poptorch.optim's)


def attribute_keys(optimizer: torch.optim.Optimizer) -> AttributeKeys:
    """The optimizer's public attributes and each param group's keys (at compile), and
    the (empty) set of attributes already warned about for this model."""
    own = frozenset(k for k in own_attribute_names(optimizer) if not k.startswith("_"))
    return own, [frozenset(group) for group in optimizer.param_groups], set()


def warn_unexpected_attributes(compiled: AttributeKeys,
                               optimizer: torch.optim.Optimizer, relaxed: bool) -> None:
    """As PopTorch: attributes that appear on an optimizer after its model was compiled
    are not part of the compiled update; say so once per attribute and model (WARNING),
    unless ``Options.relaxOptimizerAttributesChecks()`` was set."""
    if relaxed:
        return
    own, groups = attribute_keys(optimizer)[:2]
    warned = compiled[2]
    for name in sorted(own - compiled[0]):
        if ("optimizer", name) not in warned:
            warned.add(("optimizer", name))
            logger.warning("setOptimizer: unexpected optimizer attribute %r (it was not "
                           "there when the model was compiled): it is not part of the "
                           "compiled update and is ignored.", name)
    for i, keys in enumerate(groups):
        known = compiled[1][i] if i < len(compiled[1]) else frozenset()
        for name in sorted(keys - known):
            if ("group", i, name) not in warned:
                warned.add(("group", i, name))
                logger.warning("setOptimizer: unexpected group %d attribute %r (it was not "
                               "there when the model was compiled): it is not part of the "
                               "compiled update and is ignored.", i, name)
