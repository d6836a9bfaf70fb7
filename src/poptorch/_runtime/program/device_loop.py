"""The device program: what one call of a compiled executor runs.

One call performs ``d`` device iterations. In training each is one optimizer step over
``g * r`` micro-batches: forward and backward for each (through the step runner), the
gradient reduction, loss-scale checks and the optimizer update. Outputs are kept only as
the output mode needs them.
"""
from __future__ import annotations

import contextlib
import time
from typing import Any, Callable

import torch

from ...enums import MeanReductionStrategy, OutputMode, ReductionType
from ...errors import Error
from .. import context
from ..batching.plan import BatchPlan, OutputCollector, split_inputs
from ..batching.structures import register_mapping_outputs
from ..config import RuntimeConfig, TrainingConfig
from .loss import find_loss
from .optimizer import fast_step
from .perf import PerfCounters
from .runner import SequentialRunner, StepRunner
from .step import infer_step, train_step


def detach(output: Any) -> Any:
    """Detach every tensor of an output structure (fast paths for common shapes)."""
    if isinstance(output, torch.Tensor):
        return output.detach()
    if type(output) is tuple and all(isinstance(t, torch.Tensor) for t in output):
        return tuple(t.detach() for t in output)  # (a namedtuple goes through pytree)
    from ..torch_internals import pytree
    register_mapping_outputs(output)  # dict-like outputs: gathered key by key
    return pytree.tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t,
                           output)


def detach_needed(output: Any) -> Any:
    """:py:func:`detach` for an inference output: tensors computed without gradients
    are returned as they are (the common single tensor / tuple of tensors without a
    copy of the tuple)."""
    if isinstance(output, torch.Tensor):
        return output.detach() if output.requires_grad else output
    if type(output) is tuple:
        for t in output:
            if not isinstance(t, torch.Tensor) or t.requires_grad:
                return detach(output)
        return output
    return detach(output)


class RngScope:
    """Runs the device program on its own random-number stream.

    With ``Options.randomSeed`` set, the executor owns a generator state seeded once;
    each call swaps it in and out of torch's default generator, so the same seed gives
    the same results run to run and the host's random stream is left untouched. A
    call that fails leaves the program's stream where it was (the call is undone).
    """

    def __init__(self, seed: int | None, device: torch.device) -> None:
        self.enabled = seed is not None
        self.cuda = device.type == "cuda"
        self.device = device
        self.state: torch.Tensor | None = None
        self.cuda_state: torch.Tensor | None = None
        if seed is not None:
            self.seed = int(seed)
            self.state = torch.Generator().manual_seed(self.seed).get_state()
            if self.cuda:
                g = torch.Generator(device=device).manual_seed(self.seed)
                self.cuda_state = g.get_state()

    def __enter__(self) -> None:
        if not self.enabled:
            return
        assert self.state is not None  # (set with ``enabled``)
        self._saved = torch.get_rng_state()
        torch.set_rng_state(self.state)
        if self.cuda:
            assert self.cuda_state is not None
            self._saved_cuda = torch.cuda.get_rng_state(self.device)
            torch.cuda.set_rng_state(self.cuda_state, self.device)

    def __exit__(self, exc_type: Any = None, *exc: Any) -> None:
        if not self.enabled:
            return
        if exc_type is None:  # a failed call keeps the state it started from
            self.state = torch.get_rng_state()
        torch.set_rng_state(self._saved)
        if self.cuda:
            if exc_type is None:
                self.cuda_state = torch.cuda.get_rng_state(self.device)
            torch.cuda.set_rng_state(self._saved_cuda, self.device)


class DeviceProgram:
    """Runs the calls of one compiled executor (see module docstring)."""

    def __init__(self, *, plan: BatchPlan, runner: StepRunner, training: bool,
                 output_mode: OutputMode, output_return_period: int,
                 params: list[torch.nn.Parameter], optimizer: Any, config: RuntimeConfig,
                 rng: RngScope, to_host: Callable[[Any], Any] | None,
                 anchors: Callable[[int], None] | None, cross: Any = None) -> None:
        self.plan = plan
        self.runner = runner
        self.training = training
        self.output_mode = output_mode
        self.output_return_period = output_return_period
        self.params = params
        # Replaces the optimizer's step when set (``_runtime/memory/sharding.py``).
        self.step_override: Callable[[], Any] | None = None
        self.optimizer = optimizer  # a property: also picks the fast step function
        self.rng = rng
        self.to_host = to_host
        self.anchors = anchors
        self.perf = PerfCounters()
        self.scaler = None
        self.last_compute_seconds = 0.0
        # Context managers entered around the device loop of every call (profiling,
        # precision), and the check run after every step; empty / None when unused.
        self.wrappers: list = []
        # Thread-local contexts of callers (the executor's casting) for worker threads.
        self.thread_contexts: list = []
        self._contexts_shared = False
        self.finite_check: Callable[[Any, Any], None] | None = None
        self.named_params: list = []
        # The whole call as one compiled graph (``compiled_step.CompiledCall``), set
        # by the executor with the inductor backend; None: the eager loop below.
        self.compiled: Any = None
        # The cross-process side (distributed.replicas.CrossProcessReplicas) of a run of
        # several processes, None in one process.
        self.cross = cross
        self._training_config = config.training
        self._averaged = cross.averaged_over if cross is not None else 1
        self._configure_reduction(config.training,
                                  cross.world.size if cross is not None else 1,
                                  self._averaged)

    def _configure_reduction(self, training: TrainingConfig, processes: int,
                             averaged: int) -> None:
        """How the summed gradients become PopTorch's Mean / Sum. ``averaged``: the
        cross-process reduction already divided them by that many processes (DDP)."""
        reduction = training.reduction
        if reduction == ReductionType.NoReduction:
            raise Error(
                "Training.accumulationAndReplicationReductionType(NoReduction) is not "
                "valid for gradients: use ReductionType.Mean (the default) or Sum.")
        n = self.plan.per_step * processes  # micro-batches of a step, all processes
        mean = reduction == ReductionType.Mean and n > 1
        strategy = training.mean_strategy
        # Post: sum the gradients, divide once before the update. Running / PostAndLoss:
        # scale each micro-batch loss by 1/n (the same mean, rounded differently).
        post = mean and strategy == MeanReductionStrategy.Post
        self.loss_multiplier = 1.0 / n if mean and not post else 1.0
        # An average over the processes is a sum divided by their number: divide by the
        # rest of n (an integer), or undo it for a sum.
        self.divide_grads_by = n // averaged if post else 1
        self.multiply_grads_by = 1 if post else averaged

    @property
    def optimizer(self) -> Any:
        """The optimizer that updates the device parameters."""
        return self._optimizer

    @optimizer.setter
    def optimizer(self, optimizer: Any) -> None:
        self._optimizer = optimizer
        self._step: Any = None if optimizer is None else fast_step(optimizer)

    def set_scaler(self, scaler: Any) -> None:
        """Install (or remove, with None) the loss scaler used by training steps."""
        self.scaler = scaler

    def _loss_of(self, output: Any) -> torch.Tensor:
        loss = find_loss(output, context.take_marked_losses())
        if not loss.requires_grad:
            loss = self._zero_gradient_loss(loss)
        if self.loss_multiplier != 1.0:
            loss = loss * self.loss_multiplier
        if self.scaler is not None:
            loss = self.scaler.scale(loss)
        return loss

    def _zero_gradient_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """A loss that depends on no trainable parameter (PopTorch accepts it): every
        parameter gets a zero gradient, so the optimizer still steps (weight decay,
        momentum) as PopTorch's would."""
        from ..._logging import log_once
        import logging
        log_once(logging.WARNING, ("loss without gradient",),
                 "The training model's loss does not depend on any trainable parameter: "
                 "its gradients are zero.")
        if not self.params:  # nothing to train (all frozen): the backward pass is a no-op
            return loss.detach() + torch.zeros((), device=loss.device, requires_grad=True)
        anchor = sum((p.reshape(-1)[0] * 0.0 for p in self.params),
                     torch.zeros((), device=loss.device))
        return loss.detach() + anchor

    def follow_cross_reduction(self) -> None:
        """Reconfigure the Mean / Sum when DDP took over the cross-process reduction
        (it averages over the processes)."""
        cross = self.cross
        if cross is not None and cross.averaged_over != self._averaged:
            self._averaged = cross.averaged_over
            self._configure_reduction(self._training_config, cross.world.size,
                                      self._averaged)

    def _update(self) -> None:
        (self.step_override or self._step)()

    def _train_step(self, microbatches: list) -> list:
        """The eager driver of :py:func:`step.train_step`: gradients accumulate into
        fresh ``.grad`` tensors through the program's runner."""
        for p in self.params:
            p.grad = None
        return train_step(self, microbatches, self.runner, self._loss_of, self._update)

    def _collect(self, collector: OutputCollector, i: int, outputs: list) -> None:
        strip = detach if self.training else detach_needed  # inference ran in no_grad
        for n, out in enumerate(outputs):
            if collector.wants(i, n):
                collector.add(n, strip(out))
        if self.finite_check is not None:
            self.finite_check(outputs, self.named_params)
        if self.anchors is not None:
            self.anchors(i)

    def _infer(self, microbatches: list) -> list:
        with torch.no_grad():
            outputs = self.runner(microbatches, None)
        context.take_marked_losses()
        return outputs

    def _loop(self, steps: list, collector: OutputCollector, t_prev: float) -> float:
        """The device iterations of one call; returns the time the last one ended."""
        perf = self.perf.counters
        if self.training or self.anchors is not None:
            # One runner call per iteration: training updates the weights in between,
            # and anchors read the model after each iteration.
            iterate = self._train_step if self.training else self._infer
            for i, microbatches in enumerate(steps):
                perf["input"].append(t_prev)
                perf["input_complete"].append(time.perf_counter())
                self._collect(collector, i, iterate(microbatches))
                t_prev = time.perf_counter()
                perf["output"].append(t_prev)
            return t_prev
        # No update between inference iterations: one runner call takes all d * r
        # micro-batches, so a pipeline stays full across iterations.
        perf["input"].extend([t_prev] * len(steps))
        perf["input_complete"].extend([time.perf_counter()] * len(steps))
        outputs = self._infer([mb for step in steps for mb in step])
        per = self.plan.per_step
        for i in range(len(steps)):
            self._collect(collector, i, outputs[i * per:(i + 1) * per])
        t_prev = time.perf_counter()
        perf["output"].extend([t_prev] * len(steps))
        return t_prev

    def _run_compiled(self, args: tuple, kwargs: dict) -> Any:
        """One call through the compiled graph; perf counters as one bulk iteration."""
        t_start = time.perf_counter()
        context.take_marked_losses()
        with context.running_on_ipu(), self.rng:
            result = self.compiled(args, kwargs)
        if self.to_host is not None:
            result = self.to_host(result)
        t_end = time.perf_counter()
        d = self.plan.device_iterations
        perf = self.perf.counters
        perf["input"][:] = perf["input_complete"][:] = [t_start] * d
        perf["output"][:] = perf["output_complete"][:] = [t_end] * d
        self.last_compute_seconds = t_end - t_start
        return result

    def single_ready(self) -> bool:
        """Whether :py:meth:`run_single` may run this program's calls: one micro-batch
        per call on the CPU through the default runner, with nothing around the steps
        (profiling, precision checks, anchors, several processes)."""
        return (self.plan.factor == 1 and type(self.runner) is SequentialRunner
                and not self.wrappers and self.anchors is None
                and self.finite_check is None and self.to_host is None
                and self.cross is None)

    def run_single(self, args: tuple, kwargs: dict) -> Any:
        """:py:meth:`run` for a program where :py:meth:`single_ready` holds: the same
        results, perf counters and errors, without the batching and output machinery
        that one micro-batch does not need."""
        if self.compiled is not None:
            return self._run_either(self._single_loop, args, kwargs)
        return self._single_loop(args, kwargs)

    def _single_loop(self, args: tuple, kwargs: dict) -> Any:
        """The eager path of :py:meth:`run_single`."""
        marked = context.marked_losses()
        if marked:
            marked.clear()  # drop marks left by runs outside the executor
        state = context.thread_state()
        depth = state.depth
        state.depth = depth + 1
        rng = self.rng if self.rng.enabled else None
        perf_counter = time.perf_counter
        t_start = perf_counter()
        failed = None
        try:
            if rng is not None:
                rng.__enter__()
            if self.training:
                output = detach(self._train_step([(args, kwargs)])[0])
            else:
                runner: Any = self.runner  # a SequentialRunner (single_ready)
                output = infer_step(runner.forward, args, kwargs)
                if marked:
                    marked.clear()
                output = detach_needed(output)
        except BaseException as error:
            failed = type(error)
            raise
        finally:
            state.depth = depth
            if rng is not None:
                rng.__exit__(failed)
        t_end = perf_counter()
        self.perf.record_single(t_start, t_end)
        self.last_compute_seconds = t_end - t_start
        return output

    def _share_thread_contexts(self) -> None:
        """Give runners that use worker threads (pipelines) the thread-local part of
        the wrappers (``thread_context()``: torch function modes)."""
        factories = list(self.thread_contexts) + [
            f for f in (getattr(w, "thread_context", None) for w in self.wrappers)
            if f is not None]
        runner: Any = self.runner
        while runner is not None:
            if hasattr(runner, "worker_contexts"):
                runner.worker_contexts = factories
            runner = getattr(runner, "inner", None)
        self._contexts_shared = True

    def run(self, args: tuple, kwargs: dict) -> Any:
        """Run one call on inputs already on the device; return host outputs."""
        if self.compiled is None:
            return self._run_loop(args, kwargs)
        return self._run_either(self._run_loop, args, kwargs)

    def _run_either(self, loop: Callable[[tuple, dict], Any], args: tuple,
                    kwargs: dict) -> Any:
        """A call through the compiled program when it is ready, else through ``loop``
        (the eager path); timed for the compiled program's backend trial while it
        runs (``backend_trial.BackendTrial``)."""
        from .compiled_step import CaptureFailed
        compiled = self.compiled
        use = compiled.ready()
        trial = compiled.trial
        t_start = time.perf_counter() if trial is not None else 0.0
        result = None
        if use:
            try:
                result = self._run_compiled(args, kwargs)
            except CaptureFailed:
                use = False  # logged once; this call and the next ones run the loop
        if not use:
            result = loop(args, kwargs)
        if trial is not None:
            trial.record(use, time.perf_counter() - t_start)
        return result

    def _run_loop(self, args: tuple, kwargs: dict) -> Any:
        """The eager device loop of one call."""
        t_start = time.perf_counter()
        steps = split_inputs(self.plan, args, kwargs)  # raises before anything runs
        collector = OutputCollector(self.plan, self.output_mode, self.output_return_period)
        perf = self.perf.counters
        for key in perf:
            perf[key].clear()
        t_prev = t_start
        context.take_marked_losses()  # drop marks left by runs outside the executor
        with context.running_on_ipu(), self.rng:
            if not self._contexts_shared:
                self._share_thread_contexts()
            if self.wrappers:
                with contextlib.ExitStack() as stack:
                    for wrapper in self.wrappers:
                        stack.enter_context(wrapper)
                    t_prev = self._loop(steps, collector, t_prev)
            else:
                t_prev = self._loop(steps, collector, t_prev)
        result = collector.result()
        if self.to_host is not None:
            result = self.to_host(result)
        t_end = time.perf_counter()
        perf["output_complete"].extend([t_end] * len(perf["output"]))
        self.last_compute_seconds = t_prev - t_start
        return result
