"""The device program: what one call of a compiled executor runs, whatever the backend.

One call performs ``d`` device iterations. In training each is one optimizer step over
``g * r`` micro-batches (``step.train_step``: the backend's runner runs forward and
backward of each, then the reduction, loss-scale checks and the backend's update).
Outputs are kept only as the output mode needs them. The backend of each call is the
selector's (``backend_trial.BackendSelector``): eager, compiled, or one of them while
the trial measures; this loop is the same for all of them.
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

import torch

from ..._typing import UserOutput
from ...errors import Error
from .. import context
from ..batching.plan import BatchPlan, OutputCollector, split_inputs
from ..batching.structures import register_mapping_outputs
from ..torch_internals import optimizer_post_hooks_registered, pytree, set_grad_enabled
from .backend_trial import BackendSelector
from .backends import Backend
from .cuda_graphs import CaptureFailed, CudaGraphCall, cuda_graph_call
from .optimizer import OptimizerBinding
from .perf import PerfCounters
from .rng import RngScope
from .runner import StepRunner
from .spec import ProgramSpec
from .step import CrossProcess, GradientScaling, LossRule, train_step
from .undo import StateUndo

__all__ = ["DeviceProgram", "detach", "detach_needed"]


_Tensor = torch.Tensor
# (the common shapes are tested as ``type(output) is tuple`` first: ``isinstance`` of a
# non-tensor against ``torch.Tensor`` takes its metaclass's slow path)


def detach(output: UserOutput) -> UserOutput:
    """Detach every tensor of an output structure (fast paths for common shapes)."""
    if type(output) is tuple:  # (a namedtuple goes through pytree)
        for t in output:  # (a loop: a generator costs more than the test)
            if not isinstance(t, _Tensor):
                break
        else:
            return tuple([t.detach() for t in output])
    elif isinstance(output, _Tensor):
        return output.detach()
    register_mapping_outputs(output)  # dict-like outputs: gathered key by key
    return pytree.tree_map_only(_Tensor, lambda t: t.detach(), output)


def detach_needed(output: UserOutput) -> UserOutput:
    """:py:func:`detach` for an inference output: tensors computed without gradients
    are returned as they are (the common single tensor / tuple of tensors without a
    copy of the tuple)."""
    if type(output) is tuple:
        for t in output:
            if not isinstance(t, _Tensor) or t.requires_grad:
                return detach(output)
        return output
    if isinstance(output, _Tensor):
        return output.detach() if output.requires_grad else output
    return detach(output)


def _backward_refused(*_args: object, **_kwargs: object) -> None:
    raise Error(
        "backward() cannot be called explicitly on outputs of a PopTorch model. If "
        "you're using a trainingModel, the backwards pass is performed automatically "
        "when invoking the model. If you're using an inferenceModel, you should use a "
        "trainingModel instead.")


def refuse_backward(output: UserOutput, args: tuple) -> UserOutput:
    """As PopTorch: ``output.backward()`` on a tensor a model returned raises (the
    model's own backward pass has already run, or it is an inference model). A tensor
    the caller passed in and got back is left alone."""
    leaves = output if type(output) is tuple else \
        (output,) if isinstance(output, _Tensor) else pytree.tree_leaves(output)
    for t in leaves:  # (plain loops: a generator per tensor costs more than the rest)
        if isinstance(t, _Tensor):
            for a in args:
                if t is a:
                    break
            else:
                t.backward = _backward_refused  # type: ignore[method-assign]
    return output


class CallStats:
    """What the calls of a program change on it: perf counters and compute time."""

    __slots__ = ("last_compute_seconds", "perf")

    def __init__(self) -> None:
        self.perf = PerfCounters()
        self.last_compute_seconds = 0.0


class DeviceProgram:
    """Runs the calls of one compiled executor (see module docstring)."""

    def __init__(self, spec: ProgramSpec, selector: BackendSelector,
                 binding: OptimizerBinding | None) -> None:
        self.spec = spec
        self.selector = selector
        self.binding = binding
        self.stats = CallStats()
        self.stats.perf.synthetic = spec.synthetic
        self._loss_rule = None if binding is None else LossRule(list(spec.params), binding)
        self._scaling: tuple[int, GradientScaling] | None = None
        self._graphs = cuda_graph_call(spec, binding)  # GPUs: calls as CUDA graphs

    # ------------------------------------------------------------------ read-only views
    @property
    def plan(self) -> BatchPlan:
        return self.spec.plan

    @property
    def training(self) -> bool:
        return self.spec.training

    @property
    def params(self) -> list[torch.nn.Parameter]:
        return list(self.spec.params)

    @property
    def cross(self) -> CrossProcess | None:
        return self.spec.cross

    @property
    def buffers(self) -> tuple[torch.Tensor, ...]:
        return self.spec.buffers

    @property
    def rng(self) -> RngScope:
        return self.spec.rng

    @property
    def runner(self) -> StepRunner:
        return self.spec.runner

    @property
    def perf(self) -> PerfCounters:
        return self.stats.perf

    @property
    def managed_step(self) -> Callable[[], object] | None:
        """The managed optimizer step of sharded or off-chip optimizer state
        (``memory/sharding.ManagedStep``), or None."""
        return getattr(self.selector.eager, "managed_step", None)

    @property
    def backend(self) -> str:
        """The backend the calls run: "eager", "compiled", "trial" or "compiling"."""
        return self.selector.name

    # ------------------------------------------------------------------ the step
    def gradient_scaling(self) -> GradientScaling:
        """How this step's summed gradients become PopTorch's Mean / Sum (the
        processes' reduction averages once DDP takes it over)."""
        cross = self.spec.cross
        averaged = 1 if cross is None else cross.averaged_over
        cached = self._scaling
        if cached is None or cached[0] != averaged:
            processes = 1 if cross is None else cross.world.size
            cached = self._scaling = (averaged, GradientScaling.of(
                self.spec.training_config, self.spec.plan.per_step, processes, averaged))
        return cached[1]

    def _train_step(self, backend: Backend, microbatches: list) -> list:
        assert self._loss_rule is not None  # (a training program)
        trace = self.spec.trace
        if trace is None:
            return train_step(self, microbatches, backend.runner, self._loss_rule,
                              backend.update)
        with trace.iteration(len(microbatches)):
            return train_step(self, microbatches, backend.runner, self._loss_rule,
                              backend.update)

    def _infer(self, backend: Backend, microbatches: list) -> list:
        trace = self.spec.trace
        with torch.no_grad(), \
                contextlib.nullcontext() if trace is None else trace.iteration(len(microbatches)):
            outputs = backend.runner(microbatches, None)
        context.take_marked_losses()
        return outputs

    def undo_for_call(self) -> StateUndo | None:
        """What a call must be able to undo: everything when something can fail after
        an update (a second optimizer step, the finite check of the outputs, a step
        hook after the update, a sharded or off-chip step's gather); the buffers (which
        a forward may update before it fails) and the loss scale otherwise; None when
        there is nothing to undo."""
        spec, binding = self.spec, self.binding
        plan = spec.plan
        weights = spec.training and (
            plan.device_iterations > 1 or spec.finite_check is not None
            or self.managed_step is not None
            or (binding is not None and optimizer_post_hooks_registered(binding.device)))
        scaler = None if binding is None else binding.scaler
        if not weights and not spec.buffers and scaler is None:
            return None
        tensors = list(spec.params) + list(spec.buffers) if weights else spec.buffers
        return StateUndo(tensors, scaler=scaler,
                         optimizer=binding.device if weights and binding else None)

    # ------------------------------------------------------------------ a call
    def run(self, args: tuple, kwargs: dict) -> UserOutput:
        """Run one call on inputs already on the device; return host outputs."""
        profiler = self.spec.call_profiler
        if profiler is None:
            return refuse_backward(self._run(args, kwargs), args)
        with profiler.call():
            return refuse_backward(self._run(args, kwargs), args)

    def _run(self, args: tuple, kwargs: dict) -> UserOutput:
        spec = self.spec
        t_start = time.perf_counter()
        backend = self.selector.for_call()
        graphs = self._graphs
        result = None
        if graphs is not None and self.selector.decision is not None and graphs.ready():
            result = self._replayed(graphs, backend, args, kwargs, t_start)
        if result is None:
            perf = self.stats.perf.counters
            for stamps in perf.values():
                stamps.clear()
            context.take_marked_losses()  # drop marks left by runs outside the executor
            with context.running_on_ipu(spec.training), spec.rng:
                if spec.wrappers:
                    with contextlib.ExitStack() as stack:
                        for wrapper in spec.wrappers:
                            stack.enter_context(wrapper)
                        result, t_prev = self._device_call(backend, args, kwargs, t_start)
                else:
                    result, t_prev = self._device_call(backend, args, kwargs, t_start)
            if spec.to_host is not None:
                result = spec.to_host(result)
            t_end = time.perf_counter()
            perf["output_complete"].extend([t_end] * len(perf["output"]))
            self.stats.last_compute_seconds = t_prev - t_start
        self.selector.record(backend, time.perf_counter() - t_start, spec.plan.factor)
        return result

    def _device_call(self, backend: Backend, args: tuple, kwargs: dict,
                     t_start: float) -> tuple[UserOutput, float]:
        """The device work of one call (outputs on the device) and when it ended."""
        spec = self.spec
        steps = split_inputs(spec.plan, args, kwargs)  # raises before anything runs
        collector = OutputCollector(spec.plan, spec.output_mode, spec.output_return_period)
        t_prev = self._loop(backend, steps, collector, t_start)
        result = collector.result()
        return (result if spec.training else detach_needed(result)), t_prev

    def _replayed(self, graphs: CudaGraphCall, backend: Backend, args: tuple,
                  kwargs: dict, t_start: float) -> UserOutput:
        """One call replayed as a CUDA graph (None: this call cannot, run it as usual);
        perf counters as one bulk iteration."""
        spec = self.spec

        def loop(backend: Backend, args: tuple, kwargs: dict) -> UserOutput:
            return self._device_call(backend, args, kwargs, t_start)[0]
        context.take_marked_losses()
        try:
            with context.running_on_ipu(spec.training), spec.rng:
                result = graphs(backend, loop, args, kwargs)
        except CaptureFailed:
            return None
        if spec.to_host is not None:
            result = spec.to_host(result)
        t_end = time.perf_counter()
        d = spec.plan.device_iterations
        perf = self.stats.perf.counters
        perf["input"][:] = perf["input_complete"][:] = [t_start] * d
        perf["output"][:] = perf["output_complete"][:] = [t_end] * d
        self.stats.last_compute_seconds = t_end - t_start
        return result

    def _loop(self, backend: Backend, steps: list, collector: OutputCollector,
              t_prev: float) -> float:
        """The device iterations of one call; returns the time the last one ended."""
        spec = self.spec
        perf = self.stats.perf.counters
        if spec.training or spec.anchors is not None:
            # One runner call per iteration: training updates the weights in between,
            # and anchors read the model after each iteration.
            for i, microbatches in enumerate(steps):
                perf["input"].append(t_prev)
                perf["input_complete"].append(time.perf_counter())
                outputs = self._train_step(backend, microbatches) if spec.training \
                    else self._infer(backend, microbatches)
                self._collect(collector, i, outputs)
                t_prev = time.perf_counter()
                perf["output"].append(t_prev)
            return t_prev
        # No update between inference iterations: one runner call takes all d * r
        # micro-batches, so a pipeline stays full across iterations.
        perf["input"].extend([t_prev] * len(steps))
        perf["input_complete"].extend([time.perf_counter()] * len(steps))
        outputs = self._infer(backend, [mb for step in steps for mb in step])
        if collector.keeps_all and spec.finite_check is None:
            collector.extend(outputs)  # (detached once combined: _device_call)
        else:
            per = spec.plan.per_step
            for i in range(len(steps)):
                self._collect(collector, i, outputs[i * per:(i + 1) * per])
        t_prev = time.perf_counter()
        perf["output"].extend([t_prev] * len(steps))
        return t_prev

    def _collect(self, collector: OutputCollector, i: int, outputs: list) -> None:
        spec = self.spec
        strip = detach if spec.training else detach_needed  # inference ran in no_grad
        if collector.keeps_all:
            collector.extend([strip(out) for out in outputs])
        else:
            for n, out in enumerate(outputs):
                if collector.wants(i, n):
                    collector.add(n, strip(out))
        if spec.finite_check is not None:
            spec.finite_check(outputs, list(spec.named_params))
        if spec.anchors is not None:
            spec.anchors(i)

    # ------------------------------------------------------------------ one micro-batch
    def single_ready(self) -> bool:
        """Whether :py:meth:`run_single` may run this program's calls: one micro-batch
        per call on the CPU through the default runner, with nothing around the steps
        (profiling, precision checks, anchors, several processes)."""
        spec = self.spec
        return (spec.plan.factor == 1 and spec.plain
                and not spec.wrappers and spec.anchors is None
                and spec.finite_check is None and spec.to_host is None
                and spec.cross is None and spec.call_profiler is None)

    def fast_path_ready(self) -> bool:
        """Whether the executor's fast path may call this program directly (one process,
        outputs already on the host: ``executor/program_call.py``)."""
        spec = self.spec
        return spec.cross is None and spec.to_host is None

    def run_single(self, args: tuple, kwargs: dict) -> UserOutput:
        """:py:meth:`run` for a program where :py:meth:`single_ready` holds: the same
        results, perf counters and errors, without the batching and output machinery
        that one micro-batch does not need: a training step, or the forward pass
        without gradients."""
        state = context.thread_state()
        marked = state.losses
        if marked:
            marked.clear()  # drop marks left by runs outside the executor
        spec = self.spec
        rng: RngScope | None = spec.rng
        selector = self.selector
        backend = selector.for_call()
        training = spec.training
        grad = not training and torch.is_grad_enabled()
        state.depth += 1
        state.training += training
        t_start = time.perf_counter()
        try:
            if grad:
                set_grad_enabled(False)
            if rng is None or not rng.enabled:
                output = self._single_step(backend, args, kwargs)
            else:
                with rng:  # (a failed call keeps the stream it started from)
                    output = self._single_step(backend, args, kwargs)
        finally:
            if grad:
                set_grad_enabled(True)
            state.depth -= 1
            state.training -= training
        t_end = time.perf_counter()
        stats = self.stats
        stats.perf.record_single(t_start, t_end)
        stats.last_compute_seconds = t_end - t_start
        selector.record(backend, t_end - t_start, 1)
        if training:
            return refuse_backward(detach(output), args)
        if marked:
            marked.clear()
        return refuse_backward(detach_needed(output), args)

    def _single_step(self, backend: Backend, args: tuple, kwargs: dict) -> UserOutput:
        """The step of :py:meth:`run_single` (in its grad mode)."""
        if self.spec.training:
            return self._train_step(backend, [(args, kwargs)])[0]
        return backend.runner([(args, kwargs)], None)[0]
