"""The compiled device program: the whole work of one call as one ``torch.compile`` graph.

With the ``inductor`` backend, one call of a wrapped model — ``deviceIterations`` x
``gradientAccumulation`` x replicas micro-batches, each forward, its loss and backward,
the gradient reduction and the optimizer update — is traced once by ``torch.compile``
(``fullgraph=True``) into a single program, then replayed: later calls pay one guard
check instead of the Python of every micro-batch, layer and optimizer loop.

How the step is captured (PyTorch's own machinery, nothing hand-written):

* the backward is ``torch.autograd.grad`` traced into the graph
  (``torch._dynamo.config.trace_autograd_ops``), the micro-batch gradients are summed
  in the graph in micro-batch order and written into the parameters' ``.grad`` tensors;
* the optimizer's own ``step`` (unwrapped from torch.optim's profiling and grad-mode
  decorators, run under ``no_grad`` like them) is traced after it, as torch's compiled
  optimizers are;
* the loops over device iterations and micro-batches are unrolled in the graph;
* random operations use eager's generator (inductor's ``fallback_random``), so a seeded
  model draws the same numbers as the eager path; on CUDA the program is replayed as a
  CUDA graph (inductor's ``triton.cudagraphs``).

With replicas over several processes, each step's forward and backward passes are the
compiled program and the rest of the step (the gradient sum over the processes, the
update) runs eagerly; :py:class:`CrossProcessAgreement` keeps every process on the same
path.

A training model runs its first call (and the first call after ``setOptimizer``) on the
eager path: it creates the optimizer state and tells which parameters receive gradients,
so the program is traced once, with the state it will keep, at the next call.

Capture is refused, and the call falls back to the eager device loop with one INFO line
saying why, when the step cannot be one graph: model parallelism (or several replicas
per process over several processes), anchored tensors,
precision casting or profiling wrappers, floating-point checks, loss scaling (whose
skipped steps are data-dependent), optimizer step hooks, or any model code that
``torch.compile`` cannot capture whole (data-dependent control flow, host ops).
"""
from __future__ import annotations

import functools
import inspect
import itertools
import os
import sys
import time
import types
from typing import Any, Callable

import torch

from ..._logging import info_once, logger
from .. import context
from ..batching.plan import OutputCollector, split_inputs
from .loss import LossNeedsEager, find_loss
from .backend_trial import BackendTrial, CrossProcessAgreement
from .runner import SequentialRunner
from .step import train_step
from ..torch_internals import (dynamo, dynamo_config_patch, optimizer_hooks_registered,
                               torch_function_stack_depth)

__all__ = ["CompiledCall", "capture_blocker", "compile_device_program"]

_names = itertools.count()


def capture_blocker(program: Any, runner: Any) -> str | None:
    """Why the calls of ``program`` cannot be one compiled graph, or None if they can.

    Only reasons fixed at compile time; :py:meth:`CompiledCall.blocker` adds those that
    can change between calls (loss scaling, optimizer hooks)."""
    cross = getattr(program, "cross", None)
    # Across processes the runner is the DDP wrapper of the sequential runner
    # (``distributed.ddp.SyncOnLastMicrobatch``); the compiled step bypasses it.
    inner = runner.inner if cross is not None and runner is cross.ddp_runner else runner
    if not isinstance(inner, SequentialRunner):
        return ("model parallelism or per-replica buffers run micro-batches outside one "
                "device graph")
    if program.wrappers:
        return "precision casting, strided group norm or profiling wraps every call"
    if program.anchors is not None:
        return "anchored tensors are read between device iterations"
    if program.finite_check is not None:
        return "floating-point exception checks run after every step"
    if getattr(program, "step_override", None) is not None:
        return "the optimizer state is sharded over replicas or kept off chip"
    if program.training:
        optimizer = program.optimizer
        if not isinstance(optimizer, torch.optim.Optimizer):
            return f"the optimizer {type(optimizer).__name__} is not a torch.optim.Optimizer"
        if optimizer.defaults.get("differentiable"):
            return "the optimizer is differentiable (differentiable=True)"
    return None


def _compiler() -> str:
    """torch.compile's backend: inductor; ``POPTORCH_TORCH_COMPILE_BACKEND`` may name
    another (tests use ``aot_eager``: the same capture without code generation)."""
    return os.environ.get("POPTORCH_TORCH_COMPILE_BACKEND", "inductor")


def _unwrapped_step(optimizer: torch.optim.Optimizer) -> Callable[..., Any]:
    """The optimizer's ``step`` without torch.optim's profiling / hook / grad-mode
    wrappers, which break graphs; the caller provides ``no_grad``."""
    return inspect.unwrap(type(optimizer).step)


def _detach(output: Any) -> Any:
    from ..torch_internals import pytree
    return pytree.tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t,
                           output)


def _dynamo_settings() -> Any:
    """The dynamo settings our traces need, scoped to the trace: ``trace_autograd_ops``
    lets torch.compile trace ``torch.autograd.grad`` instead of splitting the graph
    there. Nothing is changed for the rest of the process."""
    return dynamo_config_patch(trace_autograd_ops=True)


def _cuda_graph_replay(compiled: Callable[..., Any]) -> Callable[..., Any]:
    """CUDA graph replays reuse their output memory: mark each replay as a new step
    and copy the outputs out, since a call keeps several steps' outputs."""
    from ..torch_internals import pytree

    def replay(*inputs: Any) -> Any:
        torch.compiler.cudagraph_mark_step_begin()
        return pytree.tree_map(
            lambda t: t.clone() if isinstance(t, torch.Tensor) else t, compiled(*inputs))
    return replay


def _sum_grads(total: tuple | None, grads: tuple) -> tuple:
    if total is None:
        return grads
    return tuple(g if t is None else (t if g is None else t + g)
                 for t, g in zip(total, grads, strict=False))


def _device_function(program: Any, model: torch.nn.Module,
                     params: list[torch.nn.Parameter]) -> Callable[..., Any]:
    """The Python function ``torch.compile`` traces (module docstring): in training one
    optimizer step ``step(microbatches) -> outputs``; in inference the whole call
    ``call(args, kwargs) -> result``."""
    plan, training = program.plan, program.training
    mode, period = program.output_mode, program.output_return_period
    multiplier = program.loss_multiplier
    optimizer = program.optimizer
    raw_step: Any = _unwrapped_step(optimizer) if training else None

    def traced_loss(out: Any) -> torch.Tensor:
        try:
            loss = find_loss(out, context.take_marked_losses(), traced=True)
        except LossNeedsEager as error:
            raise Uncapturable(str(error)) from None
        return loss * multiplier if multiplier != 1.0 else loss

    def traced_backward(microbatches: list, loss_of: Any) -> list:
        # torch.autograd.grad (traced) per micro-batch, summed in micro-batch order and
        # written into the .grad tensors the eager call made (the same sums as eager
        # accumulation; assigning .grad would split the graph)
        total: Any = None
        outputs = []
        for args, kwargs in microbatches:
            with torch.enable_grad():
                out = model(*args, **kwargs)
                grads = torch.autograd.grad(loss_of(out), params, allow_unused=True)
            total = _sum_grads(total, grads)
            outputs.append(out)
        with torch.no_grad():
            for p, g in zip(params, total, strict=False):
                if g is not None:
                    p.grad.copy_(g)  # type: ignore[union-attr]  # the eager call made it
                elif p.grad is not None:  # eager would skip it with grad=None
                    raise Uncapturable("a parameter that had a gradient gets none")
        return outputs

    def update() -> None:
        with torch.no_grad():
            raw_step(optimizer)

    def device_step(microbatches: list) -> list:
        # the same step function as the eager loop (step.train_step)
        outputs = train_step(program, microbatches, traced_backward, traced_loss, update)
        return [_detach(out) for out in outputs]

    def device_backward(microbatches: list) -> list:
        # across processes: the step's forward and backward passes only; the rest of
        # train_step (the reduction every process shares, the update) runs eagerly
        return [_detach(out) for out in traced_backward(microbatches, traced_loss)]

    def device_call(args: tuple, kwargs: dict) -> Any:
        with torch.no_grad():
            steps = split_inputs(plan, args, kwargs)
            collector = OutputCollector(plan, mode, period)
            for i, microbatches in enumerate(steps):
                outputs = [model(*a, **k) for a, k in microbatches]
                context.take_marked_losses()
                for n, out in enumerate(outputs):
                    if collector.wants(i, n):
                        collector.add(n, _detach(out))
            return collector.result()

    # A code object of its own: torch.compile caches per code object, and every
    # executor must have its own cache entries (not share the recompile limit).
    fn = device_call if not training else \
        device_step if program.cross is None else device_backward
    name = f"poptorch_{fn.__name__}_{next(_names)}"
    code = fn.__code__.replace(co_name=name)
    if sys.version_info >= (3, 11):  # (code objects have a qualified name from 3.11 on)
        code = code.replace(co_qualname=name)
    return types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)


class CompiledCall:
    """One executor's compiled device program (module docstring).

    ``program.run`` asks :py:meth:`ready` before each call; :py:meth:`__call__` runs the
    call through the compiled graph (inside the program's RNG and running-on-IPU
    scopes). When capture fails, ``on_fallback`` is called once with the reason and the
    compiled path is abandoned for good.
    """

    def __init__(self, program: Any, model: torch.nn.Module, device: torch.device,
                 name: str, progress: bool,
                 on_fallback: Callable[[str], None], measure: bool = False) -> None:
        self.program = program
        self.model = model
        self.device = device
        self.name = name
        self.progress = progress
        self.on_fallback = on_fallback
        self.params = [p for p in model.parameters() if p.requires_grad] \
            if program.training else []
        self.failed = False
        # the compiled call (inference: (args, kwargs); training: (microbatches,))
        self._fn: Any = None
        self._optimizer: Any = None
        self._traced = False
        self._grad_params: list[torch.nn.Parameter] = []
        self._grads: list[torch.Tensor] = []
        # Training: one eager call first (optimizer state, which params get gradients).
        self._eager_calls_left = 1 if program.training else 0
        # Backend "fastest" (the automatic choice, backend_choice.py): the first calls
        # after tracing time this program against the eager loop; the faster one stays.
        self.trial = BackendTrial(self) if measure else None
        # Replicas over several processes: every process takes the same path.
        cross = getattr(program, "cross", None)
        self.agreement = None if cross is None else CrossProcessAgreement(self, cross)

    # ------------------------------------------------------------------ per call
    def blocker(self) -> str | None:
        """Reasons, changing between calls, to run this call eagerly (None: compile)."""
        program = self.program
        if not program.training:
            return None
        if program.scaler is not None:
            return "loss scaling skips steps depending on the gradients"
        if optimizer_hooks_registered(program.optimizer):
            return "optimizer step hooks are registered"
        return None

    def run_next_call_eagerly(self) -> None:
        """Run the next call on the eager loop: the executor checks the compiling call
        in Python (``overlapped_io.py``)."""
        self._eager_calls_left = max(self._eager_calls_left, 1)

    def ready(self) -> bool:
        """Whether this call goes through the compiled graph (else: the eager loop)."""
        if self.failed:
            return False
        if self.program.optimizer is not self._optimizer:
            self._fn = None  # setOptimizer: trace again after one eager call
            self._optimizer = self.program.optimizer
            self._eager_calls_left = 1 if self.program.training else 0
        if self._eager_calls_left:
            self._eager_calls_left -= 1
            return False
        if torch_function_stack_depth():
            # A torch function mode (the precision rules' casting of a call whose input
            # dtypes are new) is active: this call runs eagerly; the next ones, once
            # the rules know no casting is needed, are compiled.
            return False
        reason = self.blocker()
        if reason is not None:
            info_once(("compiled-call", self.name, reason),
                      "%s: this call runs on the eager device loop: %s.", self.name, reason)
            return False
        if self._fn is None:
            if self.program.training and all(p.grad is None for p in self.params):
                return False  # no eager step has completed yet (it raised): run one
            self._build()
        for p, grad in zip(self._grad_params, self._grads, strict=False):
            if p.grad is not grad:  # zero_grad(), or an eager step made new ones
                self._restore_grads()
                break
        if self.trial is not None and self._traced:
            return self.trial.next_turn()
        return True

    def __call__(self, args: tuple, kwargs: dict) -> Any:
        """Run one call through the compiled program; raises :py:class:`CaptureFailed`
        (with nothing run) when it cannot be captured."""
        if not self.program.training:
            return self._run(self._fn, args, kwargs)
        if self.agreement is not None:
            return self._call_across_processes(args, kwargs)
        program = self.program
        steps = split_inputs(program.plan, args, kwargs)
        if program.plan.factor == 1:  # one micro-batch: its output, in every mode
            return self._run(self._fn, steps[0])[0]
        collector = OutputCollector(program.plan, program.output_mode,
                                    program.output_return_period)
        step = self._fn
        for i, microbatches in enumerate(steps):
            if step is self._eager_step:
                outputs = step(microbatches)
            else:
                outputs = self._run(step, microbatches, first=i == 0)
                if outputs is None:  # capture failed after iteration 0: finish eagerly
                    step = self._eager_step
                    outputs = step(microbatches)
            for n, out in enumerate(outputs):
                if collector.wants(i, n):
                    collector.add(n, out)
        return collector.result()

    def _eager_step(self, microbatches: list) -> list:
        return [_detach(out) for out in self.program._train_step(microbatches)]

    def _call_across_processes(self, args: tuple, kwargs: dict) -> Any:
        """A training call of replicas over several processes: per step, the compiled
        forward and backward passes, then the rest of ``train_step`` run eagerly: the
        gradient reduction (the reducer's, which the eager path runs too while the
        compiled program may run, so every process calls the same collectives
        whichever path it takes), PopTorch's Mean / Sum, the update and the buffers'
        sync. Once the processes leave the compiled program (agreed during a step's
        reduction), the call's remaining steps run eagerly."""
        program = self.program
        steps = split_inputs(program.plan, args, kwargs)
        collector = OutputCollector(program.plan, program.output_mode,
                                    program.output_return_period)
        for i, microbatches in enumerate(steps):
            if self.failed:
                outputs = self._eager_step(microbatches)
            else:
                backward = functools.partial(self._backward_of_step, first=i == 0)
                outputs = [_detach(out) for out in train_step(
                    program, microbatches, backward, program._loss_of, program._update)]
            for n, out in enumerate(outputs):
                if collector.wants(i, n):
                    collector.add(n, out)
        return collector.result()

    def _backward_of_step(self, microbatches: list, loss_of: Any, first: bool) -> list:
        """The compiled forward and backward passes of one step (gradients in
        ``.grad``); eagerly when capture fails in a later step of the call."""
        self._restore_grads()  # the reduction of the previous step replaced them
        outputs = self._run(self._fn, microbatches, first=first)
        if outputs is None:
            for p in self.program.params:
                p.grad = None
            outputs = self.program.runner(microbatches, loss_of)
        return outputs

    def _run(self, fn: Callable[..., Any], *inputs: Any, first: bool = True) -> Any:
        """Run ``fn``. A failed (re)trace raises nothing mid-graph: it abandons the
        compiled path and raises :py:class:`CaptureFailed` in the first iteration of a
        call (nothing ran), returns None in a later one (the caller finishes eagerly).
        The call that first traces ``fn`` shows progress."""
        if self._traced:
            try:
                return fn(*inputs)
            except (dynamo().exc.TorchDynamoException, Uncapturable):
                pass
            # A guard failed and dynamo traced again, without the settings of our
            # capture (scoped to the trace, not set process-wide): a failed trace ran
            # nothing, so trace once more with them before giving up on the program.
            try:
                with _dynamo_settings():
                    return fn(*inputs)
            except (dynamo().exc.TorchDynamoException, Uncapturable) as error:
                self._fail(error)
                if first:
                    raise CaptureFailed(str(error)) from error
                return None
        from tqdm import tqdm
        t0 = time.perf_counter()
        bar = tqdm(total=1, desc=f"Compiling the device program ({self.name})",
                   leave=False, unit="program", disable=not self.progress)
        try:
            # the dynamo settings of our capture, for this trace only (dynamo reads
            # them while tracing; a later retrace that fails without them is tried
            # again with them, above)
            with _dynamo_settings():
                result = fn(*inputs)
        except (dynamo().exc.TorchDynamoException, Uncapturable) as error:
            self._fail(error)
            if first:
                raise CaptureFailed(str(error)) from error
            return None
        finally:
            bar.close()
        self._traced = True
        logger.info("%s: device program compiled in %.1f s (torch.compile, whole %s)",
                    self.name, time.perf_counter() - t0,
                    "call" if not self.program.training else "optimizer step"
                    if self.agreement is None else "forward and backward passes of a step")
        return result

    # ------------------------------------------------------------------ compile
    def _build(self) -> None:
        if self.program.training:
            # Gradients go into the .grad tensors the eager call created: writing a
            # parameter's .grad attribute inside the graph would split it.
            self._grad_params = [p for p in self.params if p.grad is not None]
            self._grads = [p.grad for p in self._grad_params if p.grad is not None]
        fn = _device_function(self.program, self.model, self.params)
        compiler = _compiler()
        if compiler != "inductor":  # e.g. aot_eager: the same capture, eager kernels
            self._fn = torch.compile(fn, fullgraph=True, backend=compiler)
        else:
            options: dict[str, Any] = {"fallback_random": True}
            if self.device.type == "cuda":
                options["triton.cudagraphs"] = True
            self._fn = torch.compile(fn, fullgraph=True, backend="inductor",
                                     options=options)
        if self.device.type == "cuda":
            self._fn = _cuda_graph_replay(self._fn)
        self._traced = False

    def _restore_grads(self) -> None:
        """The user cleared gradients (``zero_grad()``) or an eager step (the backend
        trial) made new ones: give the parameters the gradient tensors the program
        writes into back (overwritten by the next step)."""
        for p, grad in zip(self._grad_params, self._grads, strict=False):
            if p.grad is not grad:
                p.grad = grad

    def leave(self) -> None:
        """Run the eager loop from now on (the trial chose it, or the processes agreed
        to leave the compiled program): the program is dropped."""
        self.failed = True
        self._fn = None
        self.trial = None
        self.program.compiled = None
        if self.agreement is not None:
            self.agreement.release()

    def _fail(self, error: BaseException) -> None:
        # Across processes the others learn of it at the next step's reduction
        # (CrossProcessAgreement), and every process leaves together there.
        self.failed = True
        self._fn = None
        first = str(error).strip().splitlines()
        reason = f"{type(error).__name__}: {first[0] if first else ''}"
        logger.info("%s: the call cannot be compiled as one program (%s); falling back "
                    "to the eager device loop.", self.name, reason)
        self.on_fallback(reason)


class CaptureFailed(Exception):
    """Capture of the whole call failed before anything ran: use the eager loop."""


class Uncapturable(Exception):
    """Raised while tracing when the graph would differ from the eager step."""


def _compile_forward(runner: Any, model: torch.nn.Module) -> None:
    """The fallback: the eager device loop with a ``torch.compile``'d forward."""
    inner = getattr(runner, "inner", runner)
    if isinstance(inner, SequentialRunner) and inner.forward is model:
        inner.forward = torch.compile(model, backend=_compiler())


def compile_device_program(program: Any, runner: Any, model: torch.nn.Module,
                           device: torch.device, name: str, progress: bool,
                           measure: bool = False) -> None:
    """Give ``program`` its compiled whole-call path (inductor backend), or, when the
    step cannot be one graph, log why at INFO and compile the forward only. With
    ``measure`` (the ``fastest`` backend) an inference program is kept only if it is
    faster than the eager loop (:py:class:`BackendTrial`), and a step that cannot be
    one graph runs the eager loop as it is."""
    reason = capture_blocker(program, runner)
    if reason is not None:
        info_once(("compiled-call-blocked", name, reason),
                  "%s: the call is not compiled as one program (%s); the device loop "
                  "runs %s instead.", name, reason,
                  "eagerly" if measure else "a torch.compile'd forward")
        if not measure:
            _compile_forward(runner, model)
        return
    def on_fallback(_reason: str) -> None:
        if not measure:
            _compile_forward(runner, model)
    program.compiled = CompiledCall(program, model, device, name, progress, on_fallback,
                                    measure=measure)
