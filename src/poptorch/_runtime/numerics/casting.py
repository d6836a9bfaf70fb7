"""``halfFloatCasting(Default)``: a model's weights follow its activations' precision.

The user guide: "You can simply input float16 tensors into your model ... Keep the
parameters (weights) as float32 ... the parameters will be converted to float16 if you
call an operation with a float16 input". Upstream's tests pin the four cases:

* float16 activations, float32 weights: the operation computes in float16 and returns
  float16; gradients reach the float32 ("master") weights through the cast;
* float32 activations, float16 weights: the weights are cast up, the result is float32;
* same dtypes: nothing happens; activations that mix float16 and float32 among
  themselves follow PyTorch's promotion (``half + float`` is float).

bfloat16 is handled exactly like float16. "Weights" are the compiled model's parameters
and buffers (every ``torch.nn.Parameter`` counts, as do the model's buffers);
"activations" are every other tensor argument.

:class:`WeightsFollowActivations` is the :class:`~torch.overrides.TorchFunctionMode`
doing the casts. :class:`DefaultCasting` installs it around a call only when needed: the
first call with a given input dtype signature runs with the mode and counts its casts;
if it cast nothing, later calls with that signature run without it (so a float32 model
fed float32 data pays nothing). Typing is thereby fixed per input signature at its first
call, as upstream fixed it when compiling.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection, Iterable
from types import TracebackType

import torch
from torch.overrides import TorchFunctionMode

from .precision import _NEVER_CAST, _writes_in_place

__all__ = [
    "LOW_PRECISION",
    "DefaultCasting",
    "WeightsFollowActivations",
    "cast_floating",
    "floating_args",
]

LOW_PRECISION = (torch.float16, torch.bfloat16)
_CASTABLE = (torch.float16, torch.bfloat16, torch.float32)


def floating_args(values: Iterable[object], out: list) -> list:
    """Append every floating-point tensor of ``values`` (one level of lists/tuples)."""
    for v in values:
        if isinstance(v, torch.Tensor):
            if v.dtype in _CASTABLE:
                out.append(v)
        elif isinstance(v, (list, tuple)):
            for item in v:
                if isinstance(item, torch.Tensor) and item.dtype in _CASTABLE:
                    out.append(item)
    return out


def cast_floating(value: object, dtype: torch.dtype,
                  which: Callable[[torch.Tensor], bool] | None = None) -> object:
    """``value`` with its float16/bfloat16/float32 tensors (those for which
    ``which(t)`` holds, if given) cast to ``dtype``; lists/tuples one level deep."""
    if isinstance(value, torch.Tensor):
        if value.dtype in _CASTABLE and value.dtype != dtype and (which is None
                                                                  or which(value)):
            return value.to(dtype)
        return value
    if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
        return type(value)(cast_floating(v, dtype, which) for v in value)
    return value


class WeightsFollowActivations(TorchFunctionMode):
    """Casts the weights of an operation to its activations' dtype when they differ
    (see module docstring). ``casts`` counts the operations it changed."""

    def __init__(self, buffer_ids: frozenset) -> None:
        super().__init__()
        self.buffer_ids = buffer_ids
        self.casts = 0

    def is_weight(self, t: torch.Tensor) -> bool:
        return isinstance(t, torch.nn.Parameter) or id(t) in self.buffer_ids

    def target(self, args: tuple, kwargs: dict) -> torch.dtype | None:
        """The activations' dtype if the weights of this call must be cast to it."""
        found = floating_args(args, [])
        if kwargs:
            floating_args(kwargs.values(), found)
        if len(found) < 2:
            return None
        act: set = set()
        weight: set = set()
        for t in found:
            (weight if self.is_weight(t) else act).add(t.dtype)
        if len(act) != 1 or not weight or weight == act:
            return None
        (dtype,) = act
        return dtype

    def __torch_function__(self, func: Callable[..., object], types: Collection[type],
                           args: tuple[object, ...] = (),
                           kwargs: dict[str, object] | None = None) -> object:
        kwargs = kwargs or {}
        if func in _NEVER_CAST or _writes_in_place(func, kwargs):
            return func(*args, **kwargs)
        dtype = self.target(args, kwargs)
        if dtype is not None:
            self.casts += 1
            which = self.is_weight
            args = tuple(cast_floating(a, dtype, which) for a in args)
            kwargs = {k: cast_floating(v, dtype, which) for k, v in kwargs.items()}
        return func(*args, **kwargs)


def _signature(args: tuple, kwargs: dict) -> tuple:
    """The dtypes of the tensor inputs of a call (their order included)."""
    if not kwargs:
        try:  # fast path: every argument is a tensor
            return tuple([a.dtype for a in args])
        except AttributeError:
            pass
    from ..torch_internals import pytree
    leaves = pytree.tree_leaves((args, kwargs))
    return tuple(t.dtype if isinstance(t, torch.Tensor) else None for t in leaves)


class DefaultCasting:
    """Program wrapper applying :class:`WeightsFollowActivations` to the calls that need
    it (see module docstring). The executor calls :meth:`observe` with each call's
    inputs before entering the wrapper."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.buffer_ids = frozenset(id(b) for b in model.buffers())
        self.not_needed: set = set()
        self._signature: tuple | None = None
        self._modes: list = []

    def observe(self, args: tuple, kwargs: dict) -> None:
        """Record the input dtype signature of the coming call."""
        self._signature = _signature(args, kwargs)

    def settled(self, args: tuple, kwargs: dict) -> bool:
        """Observe these inputs; True if calls with their dtypes are known to need no
        casting (then a caller may skip :meth:`observe` for further calls with the same
        dtypes: the observed signature stays the same)."""
        self.observe(args, kwargs)
        return self._signature in self.not_needed

    def needed(self) -> bool:
        """Whether the coming call runs with the casting mode."""
        return self._signature not in self.not_needed

    def __enter__(self) -> None:
        mode = None
        if self._signature not in self.not_needed:
            mode = WeightsFollowActivations(self.buffer_ids)
            mode.__enter__()
        self._modes.append((mode, self._signature))

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        mode, signature = self._modes.pop()
        if mode is None:
            return
        mode.__exit__(exc_type, exc, tb)
        if exc_type is None and mode.casts == 0:
            self.not_needed.add(signature)

    def thread_context(self) -> contextlib.AbstractContextManager:
        """The mode for a worker thread running part of the current call (a pipeline
        stage): none when the call runs without it; its casts count for the call."""
        current = self._modes[-1][0] if self._modes else None
        if self._modes and current is None:
            return contextlib.nullcontext()
        return _WorkerCasting(self.buffer_ids, current)


class _WorkerCasting(WeightsFollowActivations):
    """:class:`WeightsFollowActivations` in a worker thread, adding its casts to those
    of the calling thread's mode (which decides whether later calls need one)."""

    def __init__(self, buffer_ids: frozenset, parent: WeightsFollowActivations | None) -> None:
        super().__init__(buffer_ids)
        self.parent = parent

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        if self.parent is not None:
            self.parent.casts += self.casts
