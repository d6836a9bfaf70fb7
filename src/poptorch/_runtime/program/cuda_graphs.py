"""The device loop of one call replayed as one CUDA graph.

On a GPU, a call of the eager device loop launches every kernel of ``d x g x r``
micro-batches from Python: for small models the launches, not the GPU, set the pace.
Where the loop is capturable, :py:class:`CudaGraphLoop` records one whole call (every
forward, backward, gradient reduction and optimizer update of the call) into a
``torch.cuda.CUDAGraph`` once, then each later call copies its inputs into the graph's
static input tensors and replays it: one host call, one replay.

Capture follows PyTorch's recipe (``torch.cuda.graphs``): a few real calls run first on
a side stream (they create the optimizer state, cuBLAS handles and autograd's buffers
outside the capture), then one call is captured and replayed. A captured graph keeps
addresses and Python values, so it is recorded again when they change: new parameter or
buffer storage, another optimizer (``setOptimizer``) or new hyperparameters (a learning
rate synchronised from the host). Inputs of other shapes or dtypes run that call on the
eager loop.

A program is not captured, with one INFO line saying why, where the loop needs the host
between kernels: model parallelism (host threads per stage), replicas in several
processes, anchored tensors, floating-point checks, precision casting or profiling
wrappers, loss scaling (the host decides whether to step), optimizer step hooks, or an
optimizer whose state steps on the host (Adam-style optimizers without
``capturable=True``). Model code that cannot be captured (``.item()``, printing a
tensor, data-dependent Python control flow) fails the capture: the call and the next
ones run the eager loop, with one INFO line. ``POPTORCH_CUDA_GRAPHS=0`` turns capture
off. A program compiled whole by inductor needs none of this: inductor replays it as
CUDA graphs itself (``compiled_step.py``).
"""
from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree

from ..._logging import info_once, logger
from ..batching.plan import OutputCollector, split_inputs
from ..torch_internals import torch_function_stack_depth
from .runner import SequentialRunner

__all__ = ["CudaGraphLoop", "GraphKey", "capture_blocker", "install_cuda_graphs"]

WARMUP_CALLS = 2
"""Real calls run on a side stream before a capture (optimizer state, library handles)."""


def _disabled_by_env() -> bool:
    value = os.environ.get("POPTORCH_CUDA_GRAPHS", "").strip().lower()
    return value in ("0", "false", "no", "off")


def capture_blocker(program: Any, runner: Any, device: torch.device) -> str | None:
    """Why the device loop of ``program`` cannot be one CUDA graph, or None if it can.

    Needs no GPU: every reason is read from the program's configuration."""
    if device.type != "cuda":
        return f"the device is {device.type}, not a CUDA GPU"
    if _disabled_by_env():
        return "turned off by POPTORCH_CUDA_GRAPHS=0"
    if not isinstance(runner, SequentialRunner) or type(program.runner) is not \
            SequentialRunner:
        return "model parallelism or per-replica buffers run stages from host threads"
    if getattr(program, "cross", None) is not None:
        return "replicas in several processes reduce gradients between steps"
    if program.anchors is not None:
        return "anchored tensors are read by the host between device iterations"
    if program.finite_check is not None:
        return "floating-point exception checks run on the host after every step"
    if program.wrappers:
        return "precision casting, strided group norm or profiling wraps every call"
    if program.training:
        return optimizer_blocker(program.optimizer, program.scaler)
    return None


def optimizer_blocker(optimizer: Any, scaler: Any) -> str | None:
    """Why a training step with ``optimizer`` (and loss scaler) cannot be captured."""
    from torch.optim import optimizer as torch_optimizer
    if scaler is not None:
        return "loss scaling decides on the host whether each step is taken"
    if not isinstance(optimizer, torch.optim.Optimizer):
        return f"the optimizer {type(optimizer).__name__} is not a torch.optim.Optimizer"
    if (optimizer._optimizer_step_pre_hooks or optimizer._optimizer_step_post_hooks
            or torch_optimizer._global_optimizer_pre_hooks
            or torch_optimizer._global_optimizer_post_hooks):
        return "optimizer step hooks are registered"
    if "capturable" in optimizer.defaults and not all(
            group.get("capturable") for group in optimizer.param_groups):
        return (f"{type(optimizer).__name__} counts its steps on the host: create it with "
                f"capturable=True")
    return None


def _hyperparameters(optimizer: Any) -> tuple:
    """The Python values of the optimizer's parameter groups: a graph bakes them in."""
    if optimizer is None:
        return ()
    return tuple(tuple(sorted((k, repr(v)) for k, v in group.items() if k != "params"))
                 for group in optimizer.param_groups)


class GraphKey:
    """What a captured graph depends on besides its static inputs; a call whose key
    differs records the graph again (inputs of new shapes run eagerly instead)."""

    def __init__(self, program: Any, model: torch.nn.Module, args: tuple,
                 kwargs: dict) -> None:
        self.inputs = self.input_layout(args, kwargs)
        self.storage = self.storage_of(model)
        self.optimizer = program.optimizer
        self.hyperparameters = _hyperparameters(program.optimizer)

    @staticmethod
    def input_layout(args: tuple, kwargs: dict) -> tuple:
        leaves, spec = pytree.tree_flatten((args, kwargs))
        return (spec, tuple((t.shape, t.dtype, t.device) if isinstance(t, torch.Tensor)
                            else ("value", repr(t)) for t in leaves))

    @staticmethod
    def storage_of(model: torch.nn.Module) -> tuple:
        return tuple(t.data_ptr() for t in
                     list(model.parameters()) + list(model.buffers()))

    def same_inputs(self, args: tuple, kwargs: dict) -> bool:
        """Whether a call with these inputs can replay the graph."""
        return self.input_layout(args, kwargs) == self.inputs

    def stale(self, program: Any, model: torch.nn.Module) -> str | None:
        """Why the graph must be recorded again, or None."""
        if program.optimizer is not self.optimizer:
            return "another optimizer"
        if _hyperparameters(program.optimizer) != self.hyperparameters:
            return "new optimizer hyperparameters"
        if self.storage_of(model) != self.storage:
            return "new parameter or buffer storage"
        return None


class CudaGraphLoop:
    """One program's CUDA-graph device loop (module docstring).

    It takes the place of the compiled program in ``DeviceProgram``: ``ready()`` says
    whether this call replays the graph, calling it runs the call (raising
    ``compiled_step.CaptureFailed`` when capture fails: that call runs eagerly)."""

    trial = None  # (no backend trial: the graph replays the eager loop's own kernels)

    def __init__(self, program: Any, model: torch.nn.Module, name: str,
                 loop: Callable[[tuple, dict], Any]) -> None:
        self.program = program
        self.model = model
        self.name = name
        self.loop = loop  # the eager device loop of one call, outputs on the device
        self.failed = False
        self.replays = 0
        self.captures = 0
        self._warmup_left = WARMUP_CALLS
        self._graph: Any = None
        self._key: GraphKey | None = None
        self._static_inputs: list[torch.Tensor] = []
        self._static_output: Any = None

    def ready(self) -> bool:
        """Whether this call goes through :py:meth:`__call__` (warm-up calls too)."""
        if self.failed:
            return False
        if torch_function_stack_depth():
            # The precision rules' casting mode of a call with new input dtypes (as in
            # compiled_step): this call runs eagerly, the next ones are captured.
            return False
        if self.program.training:
            reason = optimizer_blocker(self.program.optimizer, self.program.scaler)
            if reason is not None:  # setOptimizer / set_scaler since it was installed
                info_once(("cuda-graph-call", self.name, reason),
                          "%s: this call runs the eager device loop, not a CUDA graph: "
                          "%s.", self.name, reason)
                return False
        return True

    def __call__(self, args: tuple, kwargs: dict) -> Any:
        from .compiled_step import CaptureFailed
        key = self._key
        if key is not None:
            stale = key.stale(self.program, self.model)
            if stale is not None:
                logger.debug("%s: recording the CUDA graph again (%s)", self.name, stale)
                self._drop()
                self._warmup_left = 1
            elif not key.same_inputs(args, kwargs):
                raise CaptureFailed("inputs of another shape, dtype or structure")
        if self._graph is not None:
            return self._replay(args, kwargs)
        if self._warmup_left:
            self._warmup_left -= 1
            return self._side_stream(args, kwargs)
        try:
            self._capture(args, kwargs)
        except Exception as error:  # host ops in the model, unsupported kernels, ...
            self._drop()
            self.failed = True
            first = str(error).strip().splitlines()
            logger.info("%s: the device loop cannot be captured as a CUDA graph "
                        "(%s: %s); running the eager device loop.", self.name,
                        type(error).__name__, first[0] if first else "")
            raise CaptureFailed(str(error)) from error
        return self._replay(args, kwargs)

    # ------------------------------------------------------------------ internals
    def _side_stream(self, args: tuple, kwargs: dict) -> Any:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            result = self.loop(args, kwargs)
        torch.cuda.current_stream().wait_stream(stream)
        return result

    def _capture(self, args: tuple, kwargs: dict) -> None:
        leaves, spec = pytree.tree_flatten((args, kwargs))
        static = [t.detach().clone() if isinstance(t, torch.Tensor) else t for t in leaves]
        static_args, static_kwargs = pytree.tree_unflatten(static, spec)
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):  # a private memory pool per recording
            output = self.loop(static_args, static_kwargs)
        self._graph, self._static_output = graph, output
        self._static_inputs = [t for t in static if isinstance(t, torch.Tensor)]
        self._key = GraphKey(self.program, self.model, args, kwargs)
        self.captures += 1
        logger.info("%s: the device loop (%d micro-batches per call) is captured as one "
                    "CUDA graph, replayed once per call.", self.name,
                    self.program.plan.factor)

    def _replay(self, args: tuple, kwargs: dict) -> Any:
        leaves = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        for static, value in zip(self._static_inputs, leaves, strict=False):
            static.copy_(value, non_blocking=True)
        self._graph.replay()
        self.replays += 1
        # The next replay overwrites the static outputs: the caller gets copies.
        return pytree.tree_map(
            lambda t: t.clone() if isinstance(t, torch.Tensor) else t, self._static_output)

    def _drop(self) -> None:
        self._graph = self._key = self._static_output = None
        self._static_inputs = []


def device_loop(program: Any) -> Callable[[tuple, dict], Any]:
    """The eager device loop of one call with its outputs left on the device (what
    ``DeviceProgram._run_loop`` runs between splitting the inputs and copying the
    outputs to the host)."""
    def run(args: tuple, kwargs: dict) -> Any:
        steps = split_inputs(program.plan, args, kwargs)
        collector = OutputCollector(program.plan, program.output_mode,
                                    program.output_return_period)
        program._loop(steps, collector, 0.0)
        return collector.result()
    return run


def install_cuda_graphs(program: Any, runner: Any, model: torch.nn.Module,
                        device: torch.device, name: str) -> CudaGraphLoop | None:
    """Give ``program`` a CUDA-graph device loop where it can have one (module
    docstring); logs once at INFO why not on a GPU where it cannot. Returns the loop
    installed, or None."""
    if program.compiled is not None:  # inductor's whole-call program: its own graphs
        return None
    reason = capture_blocker(program, runner, device)
    if reason is not None:
        if device.type == "cuda":
            info_once(("cuda-graph-blocked", name, reason),
                      "%s: the device loop is not captured as a CUDA graph (%s); each "
                      "call launches its kernels from the host.", name, reason)
        return None
    loop = CudaGraphLoop(program, model, name, device_loop(program))
    program.compiled = loop
    return loop
