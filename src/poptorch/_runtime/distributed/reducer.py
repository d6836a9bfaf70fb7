"""The gradient reduction of one optimizer step over the replicas of every process.

Each process's ``.grad`` holds the sum over its own micro-batches; the reducer adds
those sums over all processes once per optimizer step (a Mean's division is the device
program's, which knows the global count). A parameter with no gradient on any process
keeps ``grad = None`` (optimizers skip it); one with a gradient on some process only is
reduced with zeros elsewhere.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from .collectives import all_reduce_sum
from .world import World


class GradientReducer:
    """Sums ``params``' gradients over all processes of ``world`` (see module doc)."""

    def __init__(self, world: World, params: list[torch.nn.Parameter]) -> None:
        self.group = world.group
        self.params = params

    def __call__(self, extra: Sequence[float] = ()) -> list[float]:
        """Reduce the gradients; ``extra`` values travel with them and come back summed
        over the processes (the compiled program's agreement,
        ``program/backend_trial.CrossProcessAgreement``: no collective of its own)."""
        params = self.params
        if not params:
            return list(extra)
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        present = torch.tensor([p.grad is not None for p in params] + list(extra),
                               dtype=torch.float32, device=params[0].device)
        reduced = all_reduce_sum([*grads, present], self.group)
        counts = reduced[-1].tolist()
        for p, grad, count in zip(params, reduced, counts, strict=False):
            p.grad = grad if count > 0 else None
        return counts[len(params):]
