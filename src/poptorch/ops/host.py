"""Host interaction: ``CPU`` (run a layer on the host CPU mid-model) and ``getIpuTensorId``."""
from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Callable

import torch

from .._runtime import context
from .._runtime.torch_internals import disable_dynamo
from .._typing import UserInput, UserOutput
from ..errors import Error

__all__ = ["CPU", "getIpuTensorId"]

_ids: weakref.WeakKeyDictionary[torch.Tensor, int] = weakref.WeakKeyDictionary()
_next_id = itertools.count(1)
_ids_lock = threading.Lock()


def getIpuTensorId(x: torch.Tensor) -> int:
    """A positive integer identifying the tensor object ``x`` for as long as it lives.

    The same tensor always gets the same id; distinct live tensors get distinct ids.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"getIpuTensorId expects a torch.Tensor, got {type(x).__name__}.")
    with _ids_lock:
        if x not in _ids:
            _ids[x] = next(_next_id)
        return _ids[x]


class CPU:
    """Run ``layer_to_call`` on the host CPU in the middle of a model.

    Tensor arguments are copied into persistent host buffers (``self.inputs``), the layer
    runs on them (``execute``), its results land in persistent host buffers
    (``self.outputs``) and are returned as copies on the device of the first tensor
    argument. CPU ops are for inference: inside a training executor an input that
    requires a gradient is an error; outside an executor such a call simply runs the
    layer in place so plain PyTorch training still works.

    >>> self.cpu = poptorch.CPU(self.myCpuOp, "MyCPUOp")
    >>> out = self.cpu(x)
    """

    def __init__(self, layer_to_call: Callable, ID: str) -> None:
        if not callable(layer_to_call):
            raise Error(f"CPU: layer_to_call must be callable, got {layer_to_call!r}.")
        self._layer_to_call = layer_to_call
        self._ID = ID
        self._kwargs: dict = {}
        self.inputs: list[torch.Tensor] | None = None
        self.outputs: list[torch.Tensor] | None = None
        self.in_shapes: list[torch.Size] | None = None
        self.out_shapes: list[torch.Size] | None = None
        self._in_dtypes: list[torch.dtype] | None = None
        self._single_output = True

    def registerPersistentData(self) -> None:
        """Allocate the host input buffers for ``in_shapes`` (outputs: on first execute)."""
        if self.in_shapes is None:
            raise Error(f"CPU op {self._ID!r}: call the op once before registering its data.")
        self.inputs = [torch.zeros(shape, dtype=dtype)
                       for shape, dtype in zip(self.in_shapes, self._in_dtypes or (), strict=False)]
        self.outputs = None

    def execute(self) -> list[torch.Tensor]:
        """Run the layer on ``self.inputs`` and store its results in ``self.outputs``."""
        if self.inputs is None:
            raise Error(f"CPU op {self._ID!r}: no input data; call the op with tensors.")
        with torch.no_grad():
            results = self._layer_to_call(*self.inputs, **self._kwargs)
        self._single_output = isinstance(results, torch.Tensor)
        results = [results] if self._single_output else list(results)
        if not all(isinstance(r, torch.Tensor) for r in results):
            raise Error(f"CPU op {self._ID!r}: the layer must return a tensor or a "
                        "list/tuple of tensors.")
        shapes = [r.shape for r in results]
        if self.outputs is None or shapes != self.out_shapes or \
                [o.dtype for o in self.outputs] != [r.dtype for r in results]:
            self.outputs = [torch.empty(r.shape, dtype=r.dtype) for r in results]
            self.out_shapes = shapes
        for buffer, result in zip(self.outputs, results, strict=False):
            buffer.copy_(result)
        return self.outputs

    @disable_dynamo  # host work: a compiled model breaks its graph here (lazy: no
    # torch._dynamo import until the first call)
    def __call__(self, *input: torch.Tensor, **kwargs: UserInput) -> UserOutput:
        tensors = [t for t in input if isinstance(t, torch.Tensor)]
        if len(tensors) != len(input):
            raise Error(f"CPU op {self._ID!r}: positional arguments must be tensors; pass "
                        "other values as keyword arguments.")
        if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
            if context.is_running_on_ipu():
                raise Error(f"CPU op {self._ID!r}: CPU ops are only supported in inference "
                            "models (use poptorch.inferenceModel or torch.no_grad()).")
            return self._layer_to_call(*input, **kwargs)
        shapes, dtypes = [t.shape for t in tensors], [t.dtype for t in tensors]
        if self.inputs is None or shapes != self.in_shapes or dtypes != self._in_dtypes:
            self.in_shapes, self._in_dtypes = shapes, dtypes
            self.registerPersistentData()
        for buffer, tensor in zip(self.inputs or (), tensors, strict=False):
            buffer.copy_(tensor)
        self._kwargs = kwargs
        outputs = self.execute()
        device = tensors[0].device if tensors else torch.device("cpu")
        results = [o.to(device, copy=True) for o in outputs]
        return results[0] if self._single_output else results
