"""What every call of a compiled model runs around its device program, in one place.

In order: the tensor constants put back (``TensorConstants``), the undo copies of the
call taken (buffers and loss scale, ``DeviceProgram.undo_for_call``), the optimizer's
attributes synced to the device (``OptimizerSync.before_run``), the wrapper's training
mode and the casting context entered, the program run; then the contexts left and the
optimizer synced back. A failed call leaves the contexts, puts back what the undo
copied and raises a device fault as PopTorch's error. The general path of
``PoplarExecutor`` and the per-call fast path (:mod:`.fast_call`) both run this
sequence; they differ only in what they check and prepare before it.
"""
from __future__ import annotations

from collections.abc import Callable

from .._runtime.compilation import Compilation
from .._runtime.memory import step_shards
from .._runtime.weights.modelcopy import TrainingMode
from .._typing import UserOutput
from .call_support import raise_device_fault

RunProgram = Callable[[tuple, dict], UserOutput]


class ProgramCall:
    """The call sequence of one compiled program (module docstring), bound once."""

    def __init__(self, compiled: Compilation, mode: TrainingMode) -> None:
        self._undo_for_call = compiled.program.undo_for_call
        constants = compiled.tensor_constants
        self._constants = constants if constants else None
        self._mode = mode
        self._released = step_shards.released
        self._casting = compiled.casting
        self._optimizer_sync = None if compiled.optimizer is None \
            else compiled.optimizer.sync

    def __call__(self, run: RunProgram, args: tuple, kwargs: dict, *,
                 settled: bool = False, undo: bool = True) -> UserOutput:
        """``run(args, kwargs)`` in the sequence. ``settled``: the float16 rules are known
        to cast nothing for these inputs (only the run context is entered); ``undo``:
        take the call's undo copies (the first call has an undo of its own)."""
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
