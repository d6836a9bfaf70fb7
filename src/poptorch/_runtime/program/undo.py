"""The one way a call, or a part of it, is undone: :py:class:`StateUndo`.

A PopTorch call is all or nothing: when it raises, the weights, buffers, optimizer
state, loss scale and random state are as before it. Whatever may change is copied
before it runs and written back *in place* if it fails, so that every reference the
user or a compiled program holds (a parameter, a momentum buffer) stays valid. The same
object undoes a whole call (the executor), one step whose compiled attempt failed
(``fallback.py``) and the fast path's call (``executor/program_call.py``).
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ..numerics.loss_scaling import LossScaler

__all__ = ["RandomState", "StateUndo"]


class RandomState:
    """torch's random generators (the CPU one, and ``device``'s when it is a GPU)."""

    __slots__ = ("cpu", "cuda", "device")

    def __init__(self, device: torch.device | None = None) -> None:
        self.cpu = torch.get_rng_state()
        self.device = device if device is not None and device.type == "cuda" else None
        self.cuda = None if self.device is None else torch.cuda.get_rng_state(self.device)

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.device is not None and self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda, self.device)


class StateUndo:
    """A copy of what a call may change, written back by :py:meth:`restore`.

    ``tensors``: parameters and buffers (their values); ``optimizer``: its per-parameter
    state (entries the call creates are removed, the others get their tensors' values
    and their other values back) and its parameter groups' hyperparameters;
    ``scaler``: the loss scaler's state; ``modules``: which tensor each module registers
    under each buffer name (a first call must not add or rebind buffers); ``rng``:
    torch's random generators."""

    __slots__ = ("_groups", "_modules", "_optimizer", "_rng", "_scaler", "_scaler_state",
                 "_state", "_tensors")

    def __init__(self, tensors: Iterable[torch.Tensor] = (), *,
                 optimizer: torch.optim.Optimizer | None = None,
                 scaler: LossScaler | None = None, modules: torch.nn.Module | None = None,
                 rng: RandomState | None = None) -> None:
        saved = list(tensors)
        self._optimizer = optimizer
        if optimizer is not None:
            self._state = {p: dict(s) for p, s in optimizer.state.items()}
            for values in self._state.values():
                saved.extend(v for v in values.values() if isinstance(v, torch.Tensor))
            self._groups = [{k: v for k, v in g.items() if k != "params"}
                            for g in optimizer.param_groups]
        self._tensors = [(t, t.detach().clone()) for t in saved]
        self._scaler = scaler
        self._scaler_state = None if scaler is None else scaler.state_dict()
        self._modules = None if modules is None else [
            (prefix, module, dict(module._buffers))
            for prefix, module in modules.named_modules()]
        self._rng = rng

    def buffer_changes(self) -> list[tuple[str, str]]:
        """``(qualified name, "removed" | "reassigned")`` of every buffer registration
        of ``modules`` that changed since this object was made."""
        changes = []
        for prefix, module, registered in self._modules or ():
            for name, tensor in registered.items():
                qualified = f"{prefix}.{name}" if prefix else name
                if name not in module._buffers:
                    changes.append((qualified, "removed"))
                elif module._buffers[name] is not tensor:
                    changes.append((qualified, "reassigned"))
        return changes

    def restore(self) -> None:
        """Put everything back as it was when this object was made."""
        if self._modules is not None:
            for _, module, registered in self._modules:
                buffers = module._buffers
                for name in [n for n in buffers if n not in registered]:
                    del buffers[name]
                buffers.update(registered)
        with torch.no_grad():
            for tensor, saved in self._tensors:
                tensor.copy_(saved)
        optimizer = self._optimizer
        if optimizer is not None:
            state = optimizer.state
            for p in [p for p in state if p not in self._state]:
                del state[p]  # state the undone call created
            for p, values in self._state.items():
                current = state[p]
                current.clear()
                current.update(values)  # the same tensors, their values put back
            for group, values in zip(optimizer.param_groups, self._groups, strict=False):
                group.update(values)
        if self._scaler is not None:
            assert self._scaler_state is not None  # (saved with the scaler)
            self._scaler.load_state_dict(self._scaler_state)
        if self._rng is not None:
            self._rng.restore()
