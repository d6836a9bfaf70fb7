"""Weights off chip (``setWeightLocation(TensorLocationSettings().useOnChipStorage(False))``)
in one process: kept in host memory between steps and streamed to the device block by
block, as FSDP2's ``CPUOffloadPolicy`` does for sharded weights.

The blocks are ``fsdp.units_of(model)``. Between steps each streamed weight's ``data``
is its host copy (pinned on a GPU), so the model reads as usual. During a call:

* a block's weights are loaded to the device just before its forward (the next
  block's are prefetched; on a GPU copied from pinned memory without blocking the
  host, on the compute stream: there is no side stream yet), and dropped after it:
  their device storage is freed (``untyped_storage().resize_(0)``), which autograd's
  saved tensors share;
* before the block's backward (a gradient reaches one of its outputs:
  ``register_multi_grad_hook``) they are loaded again (the previous block's
  prefetched) and dropped once every one of its weights has its gradient
  (``register_post_accumulate_grad_hook``): at most two blocks' weights are on the
  device at once;
* the update runs on the host copies (the optimizer state with them, as ZeRO-Offload's
  host optimizer), the gradients moved to host memory for it.

As for FSDP2, a block's weights are on the device only while its own forward or backward
runs: code that uses them outside the block's ``forward`` (a weight shared by two blocks
stays on the device, whole) cannot stream them. On the CPU host memory is the device's:
nothing streams (logged once at INFO) unless ``fsdp.force_stream`` is set (tests).
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from types import TracebackType

import torch
from torch.utils.hooks import RemovableHandle

from ..program.optimizer import fast_step
from ..torch_internals import pytree


class StreamedWeights:
    """The blocks' streamed weights of a model (module docstring); entered around every
    call of its program, it puts the weights back in host memory after the call."""

    def __init__(self, units: list[torch.nn.Module], device: torch.device,
                 min_elements: int) -> None:
        owners: dict[int, set[int]] = {}
        for u, unit in enumerate(units):
            for p in unit.parameters():
                owners.setdefault(id(p), set()).add(u)
        self.device = device
        self.pinned = device.type == "cuda"
        self.params: list[list[torch.nn.Parameter]] = [
            [p for p in unit.parameters() if len(owners[id(p)]) == 1
             and p.numel() >= max(min_elements, 1)] for unit in units]
        self.host: dict[int, torch.Tensor] = {}
        for group in self.params:
            for p in group:
                host = torch.empty(p.shape, dtype=p.dtype, pin_memory=self.pinned)
                host.copy_(p.data)
                self.host[id(p)] = host
                p.data = host
        # the weights whose data is their host copy now (``p.data`` is a new tensor at
        # every read, so this is kept here)
        self.at_host: set[int] = set(self.host)
        self.loaded: set[int] = set()
        self.peak_loaded = 0  # the most blocks on the device at once (accounting)
        self.pending: dict[int, int] = {}  # block -> its weights still without gradient
        self._hooks = [h for u, unit in enumerate(units) for h in self._watch(u, unit)]

    # --- moves -----------------------------------------------------------------------
    def load(self, u: int) -> None:
        """Block ``u``'s weights on the device (allocated again and copied in)."""
        if u in self.loaded or not 0 <= u < len(self.params):
            return
        self.loaded.add(u)
        self.peak_loaded = max(self.peak_loaded, len(self.loaded))
        for p in self.params[u]:
            host = self.host[id(p)]
            if id(p) in self.at_host:  # first use in this call: a device tensor
                self.at_host.discard(id(p))
                if p.grad is not None and p.grad.device != self.device:
                    p.grad = None  # (the last update's, in host memory)
                p.data = torch.empty(p.shape, dtype=p.dtype, device=self.device)
            else:
                p.data.untyped_storage().resize_(p.numel() * p.element_size())
            p.data.copy_(host, non_blocking=self.pinned)

    def drop(self, u: int) -> None:
        """Free block ``u``'s device storage (autograd's saved tensors share it)."""
        if u not in self.loaded:
            return
        self.loaded.discard(u)
        for p in self.params[u]:
            if id(p) not in self.at_host:
                p.data.untyped_storage().resize_(0)

    def to_host(self) -> None:
        """After a call: every weight's data is its host copy again (nothing loaded)."""
        for u in list(self.loaded):
            self.drop(u)
        for group in self.params:
            for p in group:
                if id(p) in self.at_host:
                    continue
                self.at_host.add(id(p))
                host = self.host[id(p)]
                grad, p.grad = p.grad, None  # (a gradient must be where the weight is)
                p.data = host
                if grad is not None:
                    p.grad = grad.to(host.device)

    # --- the hooks ---------------------------------------------------------------------
    def _watch(self, u: int, unit: torch.nn.Module) -> Iterator[RemovableHandle]:
        params = self.params[u]
        if not params:
            return

        def before_forward(*_: object) -> None:
            self.load(u)
            self.load(u + 1)  # prefetch

        def after_forward(_: torch.nn.Module, __: tuple, output: object) -> None:
            self.drop(u)
            if not torch.is_grad_enabled():
                return
            self.pending[u] = sum(p.requires_grad for p in params)
            outputs = [t for t in pytree.tree_leaves(output)
                       if isinstance(t, torch.Tensor) and t.requires_grad]
            if outputs:  # (before the block's backward: a gradient reaches an output)
                torch.autograd.graph.register_multi_grad_hook(outputs, before_backward,
                                                              mode="any")

        def before_backward(*_: object) -> None:
            self.load(u)
            self.load(u - 1)  # prefetch

        def gradient_done(_: torch.Tensor) -> None:
            left = self.pending.get(u, 0) - 1
            self.pending[u] = left
            if left <= 0:
                self.drop(u)

        yield unit.register_forward_pre_hook(before_forward)
        yield unit.register_forward_hook(after_forward)
        for p in params:
            if p.requires_grad:
                yield p.register_post_accumulate_grad_hook(gradient_done)

    def remove(self) -> None:
        """Take the hooks off when the program is dropped (the weights stay in their
        host copies: the module runs as plain PyTorch again)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    # --- around a call and the update ----------------------------------------------------
    def __enter__(self) -> None:
        self.peak_loaded = 0

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.to_host()

    def update(self, inner: Callable[[], object] | None,
               optimizer_of: Callable[[], torch.optim.Optimizer | None]
               ) -> Callable[[], object]:
        """The update on the host copies: ``inner`` (a managed step) or the optimizer's
        own step, after the weights and their gradients are moved to host memory."""
        def step() -> object:
            self.to_host()
            if inner is not None:
                return inner()
            optimizer = optimizer_of()
            assert optimizer is not None  # (only training programs update)
            return fast_step(optimizer)()
        return step
