"""Step runners: run the micro-batches of one optimizer step (or inference iteration).

A :py:class:`StepRunner` is any callable
``runner(microbatches, loss_of) -> outputs``: it runs the model on every micro-batch
and, in training, calls ``loss_of(output).backward()`` for each of them, choosing when.
Model parallelism (``_runtime/placement.py``) supplies runners that pipeline, shard or
phase the model; the default below runs micro-batches one after the other.
"""
from __future__ import annotations

from typing import Any, Callable, Protocol

import torch

from .batching import Microbatch

LossOf = Callable[[Any], torch.Tensor]


class StepRunner(Protocol):
    """Runs forward (and backward) over the micro-batches of one step."""

    def __call__(self, microbatches: list[Microbatch],
                 loss_of: LossOf | None) -> list[Any]:
        ...


class SequentialRunner:
    """Runs each micro-batch's forward, then its backward, on one device."""

    def __init__(self, forward: Callable[..., Any]) -> None:
        self.forward = forward

    def __call__(self, microbatches: list[Microbatch],
                 loss_of: LossOf | None) -> list[Any]:
        outputs = []
        forward = self.forward
        for args, kwargs in microbatches:
            out = forward(*args, **kwargs)
            if loss_of is not None:
                loss_of(out).backward()
            outputs.append(out)
        return outputs
