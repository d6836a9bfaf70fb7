"""The per-call fast path of a compiled model: the common call, with nothing to decide.

After its warm-up calls, a model is usually called again and again with inputs like
those it was compiled for. Everything the general path of ``PoplarExecutor.__call__``
works out per call (parsing and checking the arguments against the compiled signature,
detaching inputs, batch splitting, output assembly, which contexts to enter) then has
the same answer every time. :py:func:`make_fast_call` works it out once, when the model
qualifies, and :py:class:`FastCall` runs each later call with only what must happen per
call: a fingerprint check of the inputs (positional tensors of the compiled dtypes and
shapes, none requiring grad), the tensor-constant check (version counters), the
wrapper's training mode, the casting context, the program's one micro-batch
(``DeviceProgram.run_single``), the optimizer-attribute sync of a training model.

A model qualifies when one call is one micro-batch (deviceIterations,
gradientAccumulation and replicationFactor all 1) on the CPU through the default runner,
without profiling, precision checks, anchors, synthetic data or several processes, and
its float16 casting rules are known to cast nothing for these inputs. Any call that does
not fit (other inputs, keyword arguments, ...) makes :py:class:`FastCall` return
:py:data:`MISS` before doing anything, and the executor takes the general path, which
gives the same results and raises the same errors. The decision is cached in the
compilation (``Compilation.calls.fast``); the executor drops it (``fast = None``) when the
model is compiled again, destroyed or detached, or gets another optimizer.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Literal

import torch

from .._runtime import context
from .._runtime.compilation import Compilation
from .._runtime.numerics.autocast import NOT_TOP
from .._runtime.program.device_loop import detach_needed
from .._runtime.torch_internals import set_grad_enabled, tensor_inputs_check
from .._runtime.weights.modelcopy import TrainingMode

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
    strides; none requiring grad). The guard takes about a fifth of the time of
    :py:func:`_inputs_match`."""
    check = tensor_inputs_check(args)
    if check is not None and check(*args):
        return check
    dtypes = tuple(a.dtype for a in args)
    shapes = tuple(a.shape for a in args)
    return lambda *inputs: _inputs_match(inputs, dtypes, shapes)


class FastCall:
    """One compiled model's fast path (see module docstring)."""

    def __init__(self, state: Compilation, mode: TrainingMode, args: tuple) -> None:
        self._calls = state.calls
        self._program = state.program
        self._compiled = self._program.compiled
        self._count = len(args)
        self._check = _input_check(args)
        constants = state.tensor_constants
        self._constants = constants if constants else None
        self._mode = mode
        self._casting = state.casting
        self._optimizer_sync = None if state.optimizer is None else state.optimizer.sync
        # a failed call puts back the buffers its forward updated before failing
        self._buffers = state.buffers or None

    def __call__(self, args: tuple, kwargs: dict) -> Any:
        program = self._program
        if kwargs or len(args) != self._count or not self._check(*args):
            return MISS
        if program.compiled is not self._compiled:  # the fastest backend chose eager
            self._calls.fast = None  # built again after this call
            return MISS
        if self._constants is not None:
            self._constants.restore()
        opt_sync = self._optimizer_sync
        if opt_sync is not None:
            opt_sync.before_run()
        mode = self._mode
        casting = self._casting
        buffers = self._buffers
        saved = None if buffers is None else [b.clone() for b in buffers]
        mode.__enter__()
        try:
            if casting is None:
                result = program.run_single(args, kwargs)
            else:  # the float16 rules are settled: nothing to cast (make_fast_call)
                casting.enter_run()
                try:
                    result = program.run_single(args, kwargs)
                finally:
                    casting.exit_run()
        except BaseException:
            if saved is not None:
                _put_back(buffers, saved)
            raise
        finally:
            mode.__exit__(None, None, None)
        # (the CPU shares the weights with the host: nothing to mark as newer)
        if opt_sync is not None:
            opt_sync.after_run()
        return result


def _put_back(buffers: Any, saved: list) -> None:
    """Give ``buffers`` their ``saved`` values again (a failed call is undone)."""
    with torch.no_grad():
        for buffer, value in zip(buffers, saved, strict=False):
            buffer.copy_(value)


def _eager_inference(state: Compilation, mode: TrainingMode, args: tuple
                     ) -> Callable[[tuple, dict], Any]:
    """:py:class:`FastCall` of an inference model on the eager backend, with the one
    micro-batch of ``DeviceProgram.run_single`` (``step.infer_step``, inlined) run
    directly: this is the call whose host overhead shows most (a small model's forward
    takes tens of microseconds).

    Every line below runs on each call; what can be looked up once is (closure
    variables), and the executor drops this path (``calls.fast = None``) whenever the
    program or the device attachment changes."""
    calls = state.calls
    program = state.program
    runner: Any = program.runner  # (a SequentialRunner: program.single_ready())
    forward = runner.forward
    count = len(args)
    check = _input_check(args)
    constants = state.tensor_constants or None
    flags = mode.plain_flags()  # the modules' __dict__s: their training flags
    training = mode.training
    casting = state.casting
    enter_casting = casting.enter_top_run if casting is not None else None
    exit_casting: Any = casting.exit_top_run if casting is not None else None
    rng = program.rng
    program.perf.record_single(0.0, 0.0)  # one entry per counter list from now on
    stamps = program.perf.counters
    inputs, inputs_complete = stamps["input"], stamps["input_complete"]
    outputs, outputs_complete = stamps["output"], stamps["output_complete"]
    thread_state = context.thread_state()
    buffers = state.buffers or None
    perf_counter = time.perf_counter
    grad_enabled = torch.is_grad_enabled
    set_grad = set_grad_enabled
    tensor = _Tensor

    def fast_inference(args: tuple, kwargs: dict) -> Any:
        if kwargs or len(args) != count or not check(*args):
            return MISS
        if rng.enabled:  # the rng_state setter turned the program's own stream on
            calls.fast = None  # built again (as a FastCall) after this call
            return MISS
        previous_run = None
        if enter_casting is not None:
            previous_run = enter_casting()
            if previous_run is NOT_TOP:  # inside another model or a region
                return MISS
        try:
            if constants is not None:
                constants.restore()
            flipped = None
            if flags is None:
                mode.__enter__()
            else:
                for d in flags:  # (a loop that finds none: cheaper than a list)
                    if d["training"] != training:
                        flipped = [d for d in flags if d["training"] != training]
                        for d in flipped:
                            d["training"] = training
                        break
            losses = thread_state.losses
            if losses:
                losses.clear()  # marks left by runs outside the executor
            thread_state.depth += 1
            saved = None if buffers is None else [b.clone() for b in buffers]
            t_start = perf_counter()
            # step.infer_step, inlined: the forward without gradients
            grad = grad_enabled()
            if grad:
                set_grad(False)
            try:
                output = forward(*args)
            except BaseException:
                if saved is not None:  # a failed call changes nothing
                    _put_back(buffers, saved)
                raise
            finally:
                if grad:
                    set_grad(True)
                thread_state.depth -= 1
                if flags is None:
                    mode.__exit__(None, None, None)
                elif flipped is not None:
                    for d in flipped:
                        d["training"] = not training
        finally:
            if enter_casting is not None:
                exit_casting(previous_run)
        t_end = perf_counter()
        if losses:
            losses.clear()
        if len(inputs) != 1 or len(outputs_complete) != 1:  # the general path ran
            program.perf.record_single(t_start, t_end)
        else:
            inputs[0] = inputs_complete[0] = t_start
            outputs[0] = outputs_complete[0] = t_end
        program.last_compute_seconds = t_end - t_start
        if type(output) is tuple:
            for t in output:
                if type(t) is not tensor or t.requires_grad:
                    return detach_needed(output)
            return output
        return detach_needed(output)

    return fast_inference


def make_fast_call(state: Compilation, mode: TrainingMode, args: tuple, kwargs: dict
                   ) -> Callable[[tuple, dict], Any] | Literal[False] | None:
    """The fast path of a compiled model (``state``, run in the wrapper's training
    ``mode``) for calls like this one (just run on the general path): a
    :py:class:`FastCall`; None when it may qualify later (warm-up calls, casting rules
    still learning); False when it never will."""
    program = state.program
    if program is None or not program.single_ready() \
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
    if not program.training and program.compiled is None and not program.rng.enabled:
        return _eager_inference(state, mode, args)
    return FastCall(state, mode, args)
