"""What every call of a compiled model runs around its device program, and the
per-call fast path that runs it for the common call.

:py:class:`ProgramCall`, in order: the tensor constants put back
(``TensorConstants``), the undo copies of the call taken (buffers and loss scale,
``DeviceProgram.undo_for_call``), the optimizer's attributes synced to the device
(``OptimizerSync.before_run``), the wrapper's training mode and the casting context
entered, the program run; then the contexts left and the optimizer synced back. A
failed call leaves the contexts, puts back what the undo copied and raises a device
fault as PopTorch's error.

The fast path: after its warm-up calls a model is usually called again and again with
inputs like those it was compiled for, and what the general path of
``PoplarExecutor.__call__`` works out per call (parsing and checking the arguments,
detaching inputs, which contexts to enter) has the same answer every time.
:py:func:`make_fast_call` works it out once, when the model qualifies (on the CPU, in
one process, without synthetic data, its float16 rules known to cast nothing for these
inputs), and settles a :py:class:`ProgramCall` on it: each later call only checks the
inputs' fingerprint (positional tensors of the compiled dtypes and shapes, none requiring
grad) and runs the same sequence with the program's ``run`` (``run_single`` for one
micro-batch). A call that does not fit gets :py:data:`MISS` before anything runs and
takes the general path, which gives the same results and raises the same errors. The
settled call is cached in the compilation (``Compilation.calls.fast``) and dropped when
the model is compiled again, destroyed or detached, or gets another optimizer.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch

from .._runtime.compilation import Compilation
from .._runtime.memory import step_shards
from .._runtime.torch_internals import tensor_inputs_check
from .._runtime.weights.modelcopy import TrainingMode
from .._typing import UserOutput
from .call_support import raise_device_fault

RunProgram = Callable[[tuple, dict], UserOutput]


class ProgramCall:
    """The call sequence of one compiled program (module docstring), bound once; bound
    to the inputs of settled calls too (:py:meth:`settle`) when it is a fast path."""

    def __init__(self, compiled: Compilation, mode: TrainingMode) -> None:
        self._undo_for_call = compiled.program.undo_for_call
        constants = compiled.tensor_constants
        self._constants = constants if constants else None
        self._mode = mode
        self._released = step_shards.released
        self._casting = compiled.casting
        self._optimizer_sync = None if compiled.optimizer is None \
            else compiled.optimizer.sync
        # the fast path's (settle): the program's run, the inputs' count and check
        self._run: RunProgram | None = None
        self._count = -1
        self._check: Callable[..., bool] = _no_check

    def settle(self, run: RunProgram, args: tuple) -> ProgramCall:
        """Make this the fast path of calls like ``args``: ``call(args, kwargs)``
        (without ``run``) runs ``run`` settled, or answers :py:data:`MISS`."""
        self._run, self._count, self._check = run, len(args), _input_check(args)
        return self

    def __call__(self, args: tuple, kwargs: dict, run: RunProgram | None = None, *,
                 settled: bool = False, undo: bool = True) -> UserOutput:
        """``run(args, kwargs)`` in the sequence. ``settled``: the float16 rules are known
        to cast nothing for these inputs (only the run context is entered); ``undo``:
        take the call's undo copies (the first call has an undo of its own). Without
        ``run``, a fast call: inputs unlike the settled ones get :py:data:`MISS` before
        anything runs."""
        if run is None:
            if kwargs or len(args) != self._count or not self._check(*args):
                return MISS
            # (the float16 rules are settled: nothing to cast; the CPU shares the
            # weights with the host: nothing to mark as newer)
            run, settled = self._run, True
            assert run is not None
        if self._constants is not None:
            self._constants.restore()
        if self._released:  # weights of a sharded strategy, dropped after a step
            step_shards.gather_released()
        opt_sync = self._optimizer_sync
        if opt_sync is not None:
            opt_sync.before_run()
        restore = self._undo_for_call() if undo else None  # (None: nothing to undo)
        mode, casting = self._mode, self._casting
        mode.__enter__()
        try:
            if settled:
                casting.enter_run()
                try:
                    result = run(args, kwargs)
                finally:
                    casting.exit_run()
            else:
                with casting:
                    result = run(args, kwargs)
        except BaseException as error:
            mode.__exit__(None, None, None)
            if restore is not None:
                restore.restore()
            raise_device_fault(error)
            raise
        mode.__exit__(None, None, None)
        if opt_sync is not None:
            opt_sync.after_run()
        return result


MISS = object()  # a fast call's answer when the call must take the general path

_Tensor = torch.Tensor


def _no_check(*_inputs: object) -> bool:
    return False


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


def make_fast_call(state: Compilation, mode: TrainingMode, args: tuple, kwargs: dict
                   ) -> ProgramCall | Literal[False] | None:
    """The fast path of a compiled model (``state``, run in the wrapper's training
    ``mode``) for calls like this one (just run on the general path): a settled
    :py:class:`ProgramCall`; None when it may qualify later (warm-up calls, casting rules
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
    # one micro-batch per call: the driver's single-micro-batch entry
    run = program.run_single if program.single_ready() else program.run
    return ProgramCall(state, mode).settle(run, args)
