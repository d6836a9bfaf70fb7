"""The per-call fast path of a compiled model: the common call, with nothing to decide.

After its warm-up calls, a model is usually called again and again with inputs like
those it was compiled for. Everything the general path of ``PoplarExecutor.__call__``
works out per call (parsing and checking the arguments against the compiled signature,
detaching inputs, batch splitting, output assembly, which contexts to enter) then has
the same answer every time. :py:func:`make_fast_call` works it out once, when the model
qualifies, and :py:class:`FastCall` runs each later call with only what must happen per
call: a fingerprint check of the inputs (positional tensors of the compiled dtypes and
shapes, none requiring grad), the tensor-constant check (version counters), the
wrapper's training mode, the casting context, the optimizer-attribute sync of a
training model, and the device program's call, ``DeviceProgram.run`` (or, for one
micro-batch, ``run_single``): the same device program and backend as the general path,
bound once.

A model qualifies when it runs on the CPU in one process without synthetic data, and
its float16 casting rules are known to cast nothing for these inputs. Any call that does
not fit (other inputs, keyword arguments, ...) makes :py:class:`FastCall` return
:py:data:`MISS` before doing anything, and the executor takes the general path, which
gives the same results and raises the same errors. The decision is cached in the
compilation (``Compilation.calls.fast``); the executor drops it (``fast = None``) when the
model is compiled again, destroyed or detached, or gets another optimizer.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch

from .._runtime.compilation import Compilation
from .._runtime.torch_internals import tensor_inputs_check
from .._runtime.weights.modelcopy import TrainingMode
from .._typing import UserOutput
from .program_call import ProgramCall

MISS = object()  # FastCall's answer when the call must take the general path

_Tensor = torch.Tensor


def _inputs_match(args: tuple, dtypes: tuple, shapes: tuple) -> bool:
    """Whether ``args`` are plain tensors not requiring grad, of these dtypes and
    shapes: the calls the fast path was built for."""
    if len(args) != len(dtypes):
        return False
    for arg, dtype, shape in zip(args, dtypes, shapes, strict=False):
        # (dtypes are singletons: ``is`` compares them)
        if type(arg) is not _Tensor or arg.dtype is not dtype or arg.requires_grad \
                or arg.shape != shape:
            return False
    return True


def _input_check(args: tuple) -> Callable[..., bool]:
    """``check(*inputs)`` for inputs as many as ``args``: True when they are plain
    tensors like ``args`` (type, dtype, shape, and, with dynamo's C++ guard, device and
    strides; none requiring grad)."""
    check = tensor_inputs_check(args)
    if check is not None and check(*args):
        return check
    dtypes = tuple(a.dtype for a in args)
    shapes = tuple(a.shape for a in args)
    return lambda *inputs: _inputs_match(inputs, dtypes, shapes)


class FastCall:
    """One compiled model's fast path (see module docstring)."""

    def __init__(self, state: Compilation, mode: TrainingMode, args: tuple) -> None:
        program = state.program
        # one micro-batch per call: the driver's single-micro-batch entry
        self._run = program.run_single if program.single_ready() else program.run
        self._call = ProgramCall(state, mode)
        self._count = len(args)
        self._check = _input_check(args)

    def __call__(self, args: tuple, kwargs: dict) -> UserOutput:
        if kwargs or len(args) != self._count or not self._check(*args):
            return MISS
        # (the float16 rules are settled: nothing to cast; the CPU shares the weights
        # with the host: nothing to mark as newer)
        return self._call(self._run, args, kwargs, settled=True)


def make_fast_call(state: Compilation, mode: TrainingMode, args: tuple, kwargs: dict
                   ) -> Callable[[tuple, dict], UserOutput] | Literal[False] | None:
    """The fast path of a compiled model (``state``, run in the wrapper's training
    ``mode``) for calls like this one (just run on the general path): a
    :py:class:`FastCall`; None when it may qualify later (warm-up calls, casting rules
    still learning); False when it never will."""
    program = state.program
    if program is None or not program.fast_path_ready() \
            or state.synthetic is not None or state.device.type != "cpu":
        return False
    if kwargs or not all(type(a) is _Tensor for a in args):
        return None  # the inputs of a later call may qualify
    source = state.source
    if source is not None and source.fresh:
        return None
    signature = state.signature
    compiled = None if signature is None else signature.fingerprint()
    if compiled is None or len(compiled) != len(args) \
            or any((a.dtype, a.shape) != fp for a, fp in zip(args, compiled, strict=False)):
        return None  # a call that does not match the compiled inputs
    casting = state.casting
    default = getattr(casting, "default_casting", None)
    if default is not None and not default.settled(args, kwargs):
        return None
    return FastCall(state, mode, args)
