"""A whole call of the backend in force replayed as one CUDA graph.

On a GPU, a call of the device loop launches every kernel of ``d x g x r`` micro-batches
from Python: for small models the launches, not the GPU, set the pace. Where the loop is
capturable, :py:class:`CudaGraphCall` records one whole call (every forward, backward,
gradient reduction and optimizer update of the call, through the eager or the compiled
backend's pieces) into a ``torch.cuda.CUDAGraph`` once, then each later call copies its
inputs into the graph's static input tensors and replays it: one host call, one replay.
It starts once the model's backend is decided (after the trial of the automatic
backend), so a graph is never recorded from a backend that is about to change.

Capture follows PyTorch's recipe (``torch.cuda.graphs``): a few real calls run first on
a side stream (they create the optimizer state, cuBLAS handles and autograd's buffers
outside the capture), then one call is captured and replayed. A captured graph keeps
addresses and Python values, so it is recorded again when they change: another backend,
new parameter or buffer storage, another optimizer (``setOptimizer``) or new
hyperparameters (a learning rate synchronised from the host). Inputs of other shapes or
dtypes run that call without the graph.

A program is not captured, with one INFO line saying why, where the loop needs the host
between kernels: model parallelism (host threads per stage), replicas in several
processes, anchored tensors, floating-point checks, precision casting or profiling
wrappers, loss scaling (the host decides whether to step), optimizer step hooks, or an
optimizer whose state steps on the host (Adam-style optimizers without
``capturable=True``). Model code that cannot be captured (``.item()``, printing a
tensor, data-dependent Python control flow) fails the capture: the call and the next
ones run without the graph, with one INFO line. ``POPTORCH_CUDA_GRAPHS=0`` turns
capture off.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from ..._devices import env_setting
from ..._logging import describe_error, info_once, logger
from ..._typing import UserOutput
from ..torch_internals import optimizer_hooks_registered, pytree, torch_function_stack_depth

if TYPE_CHECKING:
    from ..numerics.loss_scaling import LossScaler
    from .backends import Backend
    from .optimizer import OptimizerBinding
    from .spec import ProgramSpec

__all__ = ["WARMUP_CALLS", "CaptureFailed", "CudaGraphCall", "GraphKey", "capture_blocker",
           "cuda_graph_call"]

WARMUP_CALLS = 2
"""Real calls run on a side stream before a capture (optimizer state, library handles)."""


class CaptureFailed(Exception):
    """The call cannot replay (or record) the graph: it runs without it."""


def capture_blocker(spec: ProgramSpec, binding: OptimizerBinding | None) -> str | None:
    """Why the calls of a program (its ``ProgramSpec`` and ``OptimizerBinding``) cannot
    be one CUDA graph, or None if they can. Needs no GPU: every reason is read from the
    program's configuration."""
    device = spec.device
    if device.type != "cuda":
        return f"the device is {device.type}, not a CUDA GPU"
    if env_setting("POPTORCH_CUDA_GRAPHS") is False:
        return "turned off by POPTORCH_CUDA_GRAPHS=0"
    if not spec.plain:
        return "model parallelism or per-replica buffers run stages from host threads"
    if spec.cross is not None:
        return "replicas in several processes reduce gradients between steps"
    if spec.anchors is not None:
        return "anchored tensors are read by the host between device iterations"
    if spec.finite_check is not None:
        return "floating-point exception checks run on the host after every step"
    if spec.wrappers:
        return ("precision casting, strided group norm, profiling or weights sharded over "
                "the processes wrap every call")
    if spec.training:
        assert binding is not None  # (a training program has its optimizer)
        return optimizer_blocker(binding.device, binding.scaler)
    return None


def optimizer_blocker(optimizer: object, scaler: LossScaler | None) -> str | None:
    """Why a training step with ``optimizer`` (and loss scaler) cannot be captured."""
    if scaler is not None:
        return "loss scaling decides on the host whether each step is taken"
    if not isinstance(optimizer, torch.optim.Optimizer):
        return f"the optimizer {type(optimizer).__name__} is not a torch.optim.Optimizer"
    if optimizer_hooks_registered(optimizer):
        return "optimizer step hooks are registered"
    if "capturable" in optimizer.defaults and not all(
            group.get("capturable") for group in optimizer.param_groups):
        return (f"{type(optimizer).__name__} counts its steps on the host: create it with "
                f"capturable=True")
    return None


def _hyperparameters(optimizer: torch.optim.Optimizer | None) -> tuple:
    """The Python values of the optimizer's parameter groups: a graph bakes them in."""
    if optimizer is None:
        return ()
    return tuple(tuple(sorted((k, repr(v)) for k, v in group.items() if k != "params"))
                 for group in optimizer.param_groups)


class GraphKey:
    """What a captured graph depends on besides its static inputs; a call whose key
    differs records the graph again (inputs of new shapes run without it instead)."""

    def __init__(self, backend: Backend, binding: OptimizerBinding | None,
                 tensors: list[torch.Tensor], args: tuple, kwargs: dict) -> None:
        self.backend = backend
        self.inputs = self.input_layout(args, kwargs)
        self.storage = self.storage_of(tensors)
        self.optimizer = None if binding is None else binding.device
        self.hyperparameters = _hyperparameters(self.optimizer)

    @staticmethod
    def input_layout(args: tuple, kwargs: dict) -> tuple:
        leaves, spec = pytree.tree_flatten((args, kwargs))
        return (spec, tuple((t.shape, t.dtype, t.device) if isinstance(t, torch.Tensor)
                            else ("value", repr(t)) for t in leaves))

    @staticmethod
    def storage_of(tensors: list[torch.Tensor]) -> tuple:
        return tuple(t.data_ptr() for t in tensors)

    def same_inputs(self, args: tuple, kwargs: dict) -> bool:
        """Whether a call with these inputs can replay the graph."""
        return self.input_layout(args, kwargs) == self.inputs

    def stale(self, backend: Backend, binding: OptimizerBinding | None,
              tensors: list[torch.Tensor]) -> str | None:
        """Why the graph must be recorded again, or None."""
        if backend is not self.backend:
            return "another backend"
        optimizer = None if binding is None else binding.device
        if optimizer is not self.optimizer:
            return "another optimizer"
        if _hyperparameters(optimizer) != self.hyperparameters:
            return "new optimizer hyperparameters"
        if self.storage_of(tensors) != self.storage:
            return "new parameter or buffer storage"
        return None


Loop = Callable[["Backend", tuple, dict], UserOutput]  # (backend, args, kwargs) -> device outputs


class CudaGraphCall:
    """One program's CUDA-graph call (module docstring): :py:meth:`ready` says whether
    a call goes through it, calling it runs the call (raising :py:class:`CaptureFailed`
    when this call cannot: it then runs without the graph)."""

    def __init__(self, label: str, binding: OptimizerBinding | None, tensors: list[torch.Tensor],
                 micro_batches: int) -> None:
        self.label = label
        self.binding = binding
        self.tensors = tensors  # the weights and buffers the graph reads
        self.micro_batches = micro_batches
        self.failed = False
        self.replays = 0
        self.captures = 0
        self._warmup_left = WARMUP_CALLS
        self._graph: torch.cuda.CUDAGraph | None = None
        self._key: GraphKey | None = None
        self._static_inputs: list[torch.Tensor] = []
        self._static_output: UserOutput = None

    def ready(self) -> bool:
        """Whether this call goes through :py:meth:`__call__` (warm-up calls too)."""
        if self.failed or torch_function_stack_depth():
            # (the precision rules' casting mode of a call with new input dtypes)
            return False
        binding = self.binding
        if binding is not None:
            reason = optimizer_blocker(binding.device, binding.scaler)
            if reason is not None:  # setOptimizer since the program was built
                info_once(("cuda-graph-call", self.label, reason),
                          "%s: this call is not replayed as a CUDA graph: %s.",
                          self.label, reason)
                return False
        return True

    def __call__(self, backend: Backend, loop: Loop, args: tuple, kwargs: dict) -> UserOutput:
        key = self._key
        if key is not None:
            stale = key.stale(backend, self.binding, self.tensors)
            if stale is not None:
                logger.debug("%s: recording the CUDA graph again (%s)", self.label, stale)
                self._drop()
                self._warmup_left = 1
            elif not key.same_inputs(args, kwargs):
                raise CaptureFailed("inputs of another shape, dtype or structure")
        if self._graph is not None:
            return self._replay(args, kwargs)
        if self._warmup_left:
            self._warmup_left -= 1
            return self._side_stream(backend, loop, args, kwargs)
        try:
            self._capture(backend, loop, args, kwargs)
        except Exception as error:  # host ops in the model, unsupported kernels, ...
            self._drop()
            self.failed = True
            logger.info("%s: the call cannot be captured as a CUDA graph (%s); its kernels "
                        "are launched from the host.", self.label, describe_error(error))
            raise CaptureFailed(str(error)) from error
        return self._replay(args, kwargs)

    # ------------------------------------------------------------------ internals
    @staticmethod
    def _side_stream(backend: Backend, loop: Loop, args: tuple, kwargs: dict) -> UserOutput:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            result = loop(backend, args, kwargs)
        torch.cuda.current_stream().wait_stream(stream)
        return result

    def _capture(self, backend: Backend, loop: Loop, args: tuple, kwargs: dict) -> None:
        leaves, spec = pytree.tree_flatten((args, kwargs))
        static = [t.detach().clone() if isinstance(t, torch.Tensor) else t for t in leaves]
        static_args, static_kwargs = pytree.tree_unflatten(static, spec)
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):  # a private memory pool per recording
            output = loop(backend, static_args, static_kwargs)
        self._graph, self._static_output = graph, output
        self._static_inputs = [t for t in static if isinstance(t, torch.Tensor)]
        self._key = GraphKey(backend, self.binding, self.tensors, args, kwargs)
        self.captures += 1
        logger.info("%s: the call (%d micro-batches, %s backend) is captured as one CUDA "
                    "graph, replayed once per call.", self.label, self.micro_batches,
                    backend.name)

    def _replay(self, args: tuple, kwargs: dict) -> UserOutput:
        leaves = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        for static, value in zip(self._static_inputs, leaves, strict=False):
            static.copy_(value, non_blocking=True)
        assert self._graph is not None  # (replayed after a capture)
        self._graph.replay()
        self.replays += 1
        # The next replay overwrites the static outputs: the caller gets copies.
        return pytree.tree_map_only(torch.Tensor, lambda t: t.clone(), self._static_output)

    def _drop(self) -> None:
        self._graph = self._key = self._static_output = None
        self._static_inputs = []


def cuda_graph_call(spec: ProgramSpec, binding: OptimizerBinding | None) -> CudaGraphCall | None:
    """The CUDA-graph call of a program where it can have one (module docstring); logs
    once at INFO why not on a GPU where it cannot."""
    reason = capture_blocker(spec, binding)
    if reason is not None:
        if spec.device.type == "cuda":
            info_once(("cuda-graph-blocked", spec.label, reason),
                      "%s: calls are not captured as CUDA graphs (%s); each call launches "
                      "its kernels from the host.", spec.label, reason)
        return None
    return CudaGraphCall(spec.label, binding, list(spec.params) + list(spec.buffers),
                         spec.plan.factor)
