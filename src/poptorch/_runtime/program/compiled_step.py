"""The compiled backend: one micro-batch's work compiled once, and the update.

``torch.compile`` compiles two pieces of a training step, each once per model whatever
``deviceIterations`` and ``gradientAccumulation`` are:

* the **micro-batch**: the model's forward pass, its loss (``find_loss``) and the
  backward pass, as one graph (``fused_microbatch.py``); the gradients accumulate into
  the parameters' ``.grad`` over the micro-batches exactly as the eager backend's do.
  Where that cannot be one graph, the forward pass and the loss are compiled and autograd
  runs the backward pass AOTAutograd compiled with them;
* the **update**: the optimizer's own ``step`` (torch.optim's wrappers unwrapped, under
  ``no_grad``), as torch's compiled optimizers are. Its Python hyperparameters are
  compiled in: when they change (``setOptimizer``, a learning-rate schedule synced from
  the host), the step compiles again, at most ``MAX_UPDATE_TRACES`` times; hyperparameters
  that change at consecutive steps (a per-step schedule) make the update run eagerly
  from then on, with one INFO line.

In inference only the forward pass is compiled. The loops over micro-batches, device
iterations and replicas are the device program's own (``device_loop.py``), the same for
every backend; so is what happens between the pieces: the loss scale and PopTorch's
Mean / Sum, the reduction between processes, the finite checks.

Random operations use eager's generator (inductor's ``fallback_random``): a seeded
model draws the same numbers on either backend. The first call of a model always runs
eagerly (it times the eager call and creates the optimizer state), so the pieces
compile at the second call. What happens when a compile or a compiled call fails is
``fallback.py``'s.
"""
from __future__ import annotations

import inspect
import itertools
import os
import sys
import types
from collections.abc import Callable
from typing import TypeVar

import torch

from ..._logging import info_once
from ..._typing import UserInput, UserOutput
from .. import context
from ..torch_internals import dynamo_config_patch, dynamo_eager_numerics, optimizer_hooks_registered
from .fused_microbatch import FusedCompute, Uncapturable, fused_function
from .interpreter import EagerCompute, Interpreter
from .loss import LossNeedsEager, find_loss
from .optimizer import OptimizerBinding

ForwardLoss = Callable[[tuple, dict], tuple[UserOutput, torch.Tensor]]
"""A micro-batch's forward pass and its loss: (args, kwargs) -> (output, loss)."""

__all__ = ["MAX_UPDATE_TRACES", "CompiledBackend", "Uncapturable", "torch_compile_backend",
           "update_blocker"]

MAX_UPDATE_TRACES = 4
"""How many sets of hyperparameters the update is compiled for before it runs eagerly."""

_names = itertools.count()

T = TypeVar("T")


def torch_compile_backend() -> str:
    """torch.compile's backend: inductor; ``POPTORCH_TORCH_COMPILE_BACKEND`` may name
    another (tests use ``aot_eager``: the same capture without code generation)."""
    return os.environ.get("POPTORCH_TORCH_COMPILE_BACKEND", "inductor")


def update_blocker(optimizer: object, managed_step: bool) -> str | None:
    """Why the update of ``optimizer`` runs eagerly, or None when it is compiled."""
    if managed_step:
        return "the optimizer state is sharded over replicas or kept off chip"
    if not isinstance(optimizer, torch.optim.Optimizer):
        return f"the optimizer {type(optimizer).__name__} is not a torch.optim.Optimizer"
    if optimizer.defaults.get("differentiable"):
        return "the optimizer is differentiable (differentiable=True)"
    if optimizer_hooks_registered(optimizer):
        return "optimizer step hooks are registered"
    return None


def _own_code(fn: Callable[..., T], label: str) -> Callable[..., T]:
    """``fn`` with a code object of its own: torch.compile caches per code object, and
    every model must have its own cache entries (and recompile limit)."""
    name = f"poptorch_{label}_{next(_names)}"
    code = fn.__code__.replace(co_name=name)
    if sys.version_info >= (3, 11):  # (code objects have a qualified name from 3.11 on)
        code = code.replace(co_qualname=name)
    return types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)


FUSED_GRAPH_OPTIONS: dict[str, int] = {"realize_reads_threshold": 2}
"""Inductor settings of the fused micro-batch's graph. Forward and backward are one
graph there, with no partitioner between them (AOTAutograd's decides what the backward
of a split graph saves or recomputes), so at inductor's default (a value computed once is
inlined into up to 4 kernels that read it) the backward kernels recompute forward values:
a GCN's per-node normalisation once per edge and feature block. Computing a value read
twice once made a GCN's training step 3x faster here (bench_geometric)."""


def _compile(fn: Callable[..., T], fullgraph: bool = False,
             options: dict[str, int] | None = None) -> Callable[..., T]:
    backend = torch_compile_backend()
    if backend != "inductor":  # e.g. aot_eager: the same capture, eager kernels
        compiled = torch.compile(fn, backend=backend, fullgraph=fullgraph)
    else:
        compiled = torch.compile(fn, backend="inductor",
                                 options={"fallback_random": True, **(options or {})},
                                 fullgraph=fullgraph)
    numerics = dynamo_eager_numerics()
    if not numerics:
        return compiled

    def traced_as_eager_rounds(*args: UserInput, **kwargs: UserInput) -> T:
        # (the torch releases whose dynamo rewrites ops into other roundings)
        with dynamo_config_patch(**numerics):
            return compiled(*args, **kwargs)
    return traced_as_eager_rounds


def _hyperparameters(optimizer: torch.optim.Optimizer) -> tuple:
    """The Python values of the optimizer's parameter groups (compiled in)."""
    return tuple(tuple(v for k, v in group.items() if k != "params")
                 for group in optimizer.param_groups)


class CompiledBackend:
    """The compiled backend of one model (module docstring). Its ``runner`` runs the
    micro-batches of a step through the compiled micro-batch; :py:meth:`update` steps
    the optimizer through the compiled update."""

    name = "compiled"

    def __init__(self, model: torch.nn.Module, training: bool, device: torch.device,
                 label: str, binding: OptimizerBinding | None,
                 update_eagerly: Callable[[], object] | None,
                 update_reason: str | None) -> None:
        self.label = label
        self.device = device
        self.binding = binding
        self._update_eagerly = update_eagerly  # the eager backend's update
        self._update_reason = update_reason
        forward, forward_loss = self._microbatch_functions(model, training)
        buffers = tuple(model.buffers())
        if training:  # the forward, loss and backward of a micro-batch as one graph
            assert forward_loss is not None  # (returned in training)
            fused = _compile(_own_code(fused_function(model), "fused"), fullgraph=True,
                             options=FUSED_GRAPH_OPTIONS)
            self.compute: EagerCompute | FusedCompute = FusedCompute(
                fused, forward_loss, [p for p in model.parameters() if p.requires_grad],
                binding, label)
        else:
            self.compute = EagerCompute(forward)
        self.runner = Interpreter(self.compute, buffers=buffers)
        self._update: Callable[[], object] | None = None
        # the optimizer the update is compiled for: the compile's (the model's first
        # call, eager, has created its state), then each one setOptimizer binds
        self._update_for: torch.optim.Optimizer | None = None if binding is None else binding.device
        self._traced_hyperparameters: tuple | None = None
        self._update_traces = 0
        self._changed_last_step = False

    def _microbatch_functions(self, model: torch.nn.Module, training: bool
                              ) -> tuple[Callable[..., UserOutput], ForwardLoss | None]:
        """The compiled forward (inference) and forward-with-loss (training)."""
        def forward(*args: UserInput, **kwargs: UserInput) -> UserOutput:
            out = model(*args, **kwargs)
            context.take_marked_losses()
            return out

        def forward_loss(args: tuple, kwargs: dict) -> tuple[UserOutput, torch.Tensor]:
            out = model(*args, **kwargs)
            try:
                loss = find_loss(out, context.take_marked_losses(), traced=True)
            except LossNeedsEager as error:
                raise Uncapturable(str(error)) from None
            return out, loss

        if not training:
            return _compile(_own_code(forward, "forward")), None
        return model, _compile(_own_code(forward_loss, "microbatch"))

    # ------------------------------------------------------------------ the update
    def update(self) -> None:
        """One optimizer step: compiled, or eagerly where it cannot be (see module
        docstring)."""
        binding = self.binding
        assert binding is not None and self._update_eagerly is not None  # (training)
        optimizer = binding.device
        if self._update_reason is not None or update_blocker(optimizer, False):
            self._update_eagerly()
            return
        if optimizer is not self._update_for:
            # first step with an optimizer bound by setOptimizer: eagerly, which creates
            # its state; compiled from the next step on
            self._update_for = optimizer
            self._update = None
            self._update_eagerly()
            return
        hyperparameters = _hyperparameters(optimizer)
        if hyperparameters != self._traced_hyperparameters:
            if not self._may_trace(hyperparameters):
                self._update_eagerly()
                return
        else:
            self._changed_last_step = False
        if self._update is None:
            raw_step = inspect.unwrap(type(optimizer).step)

            def update() -> None:
                with torch.no_grad():
                    raw_step(optimizer)
            self._update = _compile(_own_code(update, "update"))
        self._update()

    def _may_trace(self, hyperparameters: tuple) -> bool:
        """Whether the update may compile for new ``hyperparameters`` (else it runs
        eagerly from now on)."""
        churn = self._changed_last_step and self._traced_hyperparameters is not None
        self._changed_last_step = True
        if churn or self._update_traces >= MAX_UPDATE_TRACES:
            reason = ("the optimizer's hyperparameters change from step to step" if churn
                      else f"its hyperparameters changed {self._update_traces} times")
            self._update_reason = reason
            info_once(("compiled-update", self.label), "%s: the optimizer update runs "
                      "eagerly from now on (%s); the micro-batches stay compiled.",
                      self.label, reason)
            return False
        self._update_traces += 1
        self._traced_hyperparameters = hyperparameters
        return True
