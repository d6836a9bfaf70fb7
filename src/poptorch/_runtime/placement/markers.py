"""How block annotations reach the runtime: the per-thread *block listener*.

The public annotations (``poptorch.BeginBlock``, ``Block``, ``BlockFunction``, ``IPU``,
``recomputationCheckpoint``) do nothing by themselves: they report block boundaries to
the listener of the current thread, which the model-parallel runtime installs while it
runs the model (a tracer at compile time, a :class:`~.stagerun.StageRun` when the
stages run one after another in the calling thread).
Outside a PopTorch executor no listener is installed and an annotated model behaves
exactly like the plain model. This module is the meeting point of both sides, so that
the runtime never imports the public annotations.
"""
from __future__ import annotations

import abc
import contextlib
import itertools
import threading
from collections.abc import Iterator

import torch

from ..torch_internals import forward_pre_hooks

_listener_state = threading.local()
# Order in which BeginBlock annotations were made (the guide's ordering rule).
_annotation_counter = itertools.count()
# Class attribute of modules that start a block whenever they are called (the legacy
# wrapper form of BeginBlock and poptorch.IPU).
STARTS_BLOCK_ATTR = "_poptorch_starts_block"

#: a block's id as the user gives it (None: the next automatic id)
BlockId = str | int | None


class BlockListener(abc.ABC):
    """What the annotations report to (module docstring): a ``BlockRecorder`` of
    ``partition.py`` (the trace, both captures), a :class:`~.stagerun.StageRun`. This
    base names the blocks (auto ids for None) and lets recomputation checkpoints through."""

    _next_auto = 0  # the next automatic id (a class default: no __init__ to chain)

    def reset_auto_id(self) -> None:
        self._next_auto = 0

    def block_id(self, user_id: BlockId) -> str:
        """The block id of ``user_id`` (None: the next automatic id)."""
        if user_id is None:
            user_id = self._next_auto
            self._next_auto += 1
        return str(user_id)

    @abc.abstractmethod
    def begin_block(self, user_id: BlockId, ipu_id: int | None,
                    layer: torch.nn.Module | None = None) -> None:
        """A block starts (``layer``: the annotated module starting it, if any)."""

    def checkpoint(self, tensors: list) -> list:
        """A recomputation checkpoint of ``tensors``: what the model goes on with."""
        return tensors


def current_listener() -> BlockListener | None:
    """The block listener of this thread, or None outside a model-parallel run."""
    return getattr(_listener_state, "listener", None)


def set_listener(listener: BlockListener | None) -> BlockListener | None:
    """Install ``listener`` for this thread; returns the previous one (to restore)."""
    previous = current_listener()
    _listener_state.listener = listener
    return previous


@contextlib.contextmanager
def listening(listener: BlockListener) -> Iterator[BlockListener]:
    """Install ``listener`` as this thread's block listener (the previous one after)."""
    previous = set_listener(listener)
    try:
        yield listener
    finally:
        set_listener(previous)


def begin_block(user_id: BlockId, ipu_id: int | None,
                layer: torch.nn.Module | None = None) -> None:
    """Report the start of a block to the listener, if any."""
    listener = current_listener()
    if listener is not None:
        listener.begin_block(user_id, ipu_id, layer=layer)


class BeginBlockHook:
    """Forward pre-hook starting a block each time the annotated layer is called."""

    def __init__(self, user_id: BlockId, ipu_id: int | None, layer_name: str) -> None:
        self.user_id = user_id
        self.ipu_id = ipu_id
        self.order = next(_annotation_counter)
        self.layer_name = layer_name

    def __call__(self, module: torch.nn.Module, args: tuple) -> None:
        begin_block(self.user_id, self.ipu_id, layer=module)


def attach_begin_block(module: torch.nn.Module, user_id: BlockId,
                       ipu_id: int | None) -> None:
    """Annotate ``module`` in place (replacing an earlier annotation): a
    :class:`BeginBlockHook` among its forward pre-hooks, which is where the annotation
    is found again (also on copies of the module, which copy their hooks)."""
    detach_begin_block(module)
    module.register_forward_pre_hook(BeginBlockHook(user_id, ipu_id, type(module).__name__))


def detach_begin_block(module: torch.nn.Module) -> bool:
    """Remove the BeginBlock annotation of ``module``; False when it had none."""
    hooks = forward_pre_hooks(module)
    keys = [key for key, hook in hooks.items() if isinstance(hook, BeginBlockHook)]
    for key in keys:
        del hooks[key]
    return bool(keys)


def begin_block_of(module: torch.nn.Module) -> BeginBlockHook | None:
    """The BeginBlock annotation of ``module`` (None when it has none)."""
    for hook in forward_pre_hooks(module).values():
        if isinstance(hook, BeginBlockHook):
            return hook
    return None


def starts_block(module: torch.nn.Module) -> bool:
    """Whether calling ``module`` starts a block (a visible, static annotation)."""
    return begin_block_of(module) is not None or getattr(type(module), STARTS_BLOCK_ATTR, False)
