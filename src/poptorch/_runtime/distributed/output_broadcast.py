"""The outputs of a step, sent from the process that computed them to the others.

A pipeline whose stages run on processes computes the model's outputs on its last
stage; every process of the pipeline returns them. The first time a structure of
outputs is sent (per ``key``: the caller's input signature) it travels as a pickled
object and both sides remember its layout (tree structure, shapes, dtypes, constant
leaves); afterwards only the tensors travel, as one flat buffer per dtype, which is
what NCCL and gloo send fastest; the sender does not wait for them to arrive (it waits
before its next send), so the last stage starts its next step at once.
"""
from __future__ import annotations

from collections.abc import Hashable

import torch
import torch.distributed as dist

from ..._typing import UserOutput
from ..torch_internals import pytree
from .collectives import failures_as_errors


class OutputBroadcast:
    """Broadcasts lists of output structures from global rank ``src`` over ``group``."""

    def __init__(self, src: int, group: dist.ProcessGroup | None, device: torch.device) -> None:
        self.src = src
        self.group = group
        self.device = device
        self._layouts: dict = {}  # key -> (spec, leaves: tensor meta or constant)
        self._sending: list = []  # the sender's broadcasts in flight (work, buffer)

    def __call__(self, key: Hashable, outputs: list[UserOutput] | None) -> list[UserOutput]:
        """``outputs`` on the sender (None elsewhere); the outputs on every process."""
        with failures_as_errors("Sending the pipeline's outputs"):
            self.wait()
            layout = self._layouts.get(key)
            if layout is None:
                return self._first(key, outputs)
            return self._tensors(layout, outputs)

    def wait(self) -> None:
        """Wait until the sender's last outputs have left (before the next ones)."""
        while self._sending:
            work, _ = self._sending.pop(0)
            work.wait()

    def _first(self, key: Hashable, outputs: list[UserOutput] | None) -> list[UserOutput]:
        box: list = [None]
        if outputs is not None:
            box[0] = pytree.tree_map_only(torch.Tensor, lambda t: t.detach().cpu(), outputs)
        device = self.device if self.device.type == "cuda" else None
        dist.broadcast_object_list(box, src=self.src, group=self.group, device=device)
        leaves, spec = pytree.tree_flatten(box[0])
        metas = [("tensor", t.shape, t.dtype) if isinstance(t, torch.Tensor) else
                 ("const", t) for t in leaves]
        self._layouts[key] = (spec, metas)
        if outputs is not None:
            return outputs
        return pytree.tree_map_only(torch.Tensor, lambda t: t.to(self.device), box[0])

    def _tensors(self, layout: tuple, outputs: list[UserOutput] | None
                 ) -> list[UserOutput]:
        spec, metas = layout
        dtypes = sorted({m[2] for m in metas if m[0] == "tensor"}, key=str)
        if outputs is not None:
            leaves = [t for t in pytree.tree_leaves(outputs) if isinstance(t, torch.Tensor)]
            for dtype in dtypes:  # sent while the sender goes on (waited for next time)
                flat = torch.cat([t.detach().reshape(-1) for t in leaves if t.dtype == dtype])
                flat = flat.to(self.device)
                work = dist.broadcast(flat, src=self.src, group=self.group, async_op=True)
                self._sending.append((work, flat))
            return outputs
        received: dict = {}  # dtype -> its tensors' flat chunks, in order
        for dtype in dtypes:
            sizes = [m[1].numel() for m in metas if m[0] == "tensor" and m[2] == dtype]
            flat = torch.empty(sum(sizes), dtype=dtype, device=self.device)
            dist.broadcast(flat, src=self.src, group=self.group)
            received[dtype] = iter(flat.split(sizes))
        leaves = [m[1] if m[0] == "const" else next(received[m[2]]).view(m[1]) for m in metas]
        return pytree.tree_unflatten(leaves, spec)
