"""The training step: the one function that every driver of a training call runs.

One optimizer step over the micro-batches of a device iteration is, in order:

1. forward, loss and backward of each micro-batch (``backward``: a step runner, see
   ``runner.py``; it calls ``loss_of`` on each output and leaves the summed gradients
   in the parameters' ``.grad``);
2. the gradient reduction between processes (``cross``, several processes only);
3. PopTorch's Mean / Sum: the summed gradients divided or multiplied once;
4. the loss scaler's unscale, which may skip the update (non-finite gradients);
5. the optimizer update (``update``), then the buffers' sync between processes.

:py:func:`train_step` is that sequence. Its drivers differ only in the pieces they
pass: the eager device loop (``DeviceProgram._train_step``: the program's runner, its
loss with scaling, the optimizer's fast step) and the compiled program
(``compiled_step.py``: ``torch.compile`` of this same function with a backward that
traces ``torch.autograd.grad`` and the optimizer's unwrapped ``step``). The per-call
fast path (``executor/fast_call.py``) is a decision cached once, not another step: a
training call goes through the eager driver (``DeviceProgram.run_single``), an
inference call through :py:func:`infer_step` (its three lines inlined there: a
small model's call is that path's whole cost), the forward of one micro-batch that
``run_single`` runs too.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from .runner import LossOf
from ..torch_internals import foreach_div_, foreach_mul_, set_grad_enabled

Backward = Callable[[list, LossOf], list]


def scale_gradients(params: list[torch.nn.Parameter], divide_by: int,
                    multiply_by: int) -> None:
    """Step 3: turn the summed gradients into PopTorch's Mean / Sum (in place)."""
    if divide_by != 1 or multiply_by != 1:
        grads = [p.grad for p in params if p.grad is not None]
        if grads and divide_by != 1:
            foreach_div_(grads, float(divide_by))
        if grads and multiply_by != 1:
            foreach_mul_(grads, float(multiply_by))


def train_step(program: Any, microbatches: list, backward: Backward, loss_of: LossOf,
               update: Callable[[], Any]) -> list:
    """One optimizer step of ``program`` (a ``DeviceProgram``) over ``microbatches``
    (module docstring); returns the micro-batches' outputs (not detached)."""
    cross = program.cross
    if cross is not None:
        program.follow_cross_reduction()
        cross.begin_step()
    outputs = backward(microbatches, loss_of)
    if cross is not None:
        cross.reduce_gradients()
    params = program.params
    scale_gradients(params, program.divide_grads_by, program.multiply_grads_by)
    scaler = program.scaler
    if scaler is None or scaler.unscale_(params):
        update()
    if cross is not None:
        cross.sync_buffers()
    return outputs


def infer_step(forward: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """The forward of one inference micro-batch, without gradients whatever the host's
    grad mode: what the single-micro-batch drivers run (``DeviceProgram.run_single``
    and the fast path's inference, ``executor/fast_call.py``); the device loop's
    bulk inference runs the runner under ``no_grad`` instead."""
    grad = torch.is_grad_enabled()
    set_grad_enabled(False)
    try:
        return forward(*args, **kwargs)
    finally:
        set_grad_enabled(grad)
