"""PopTorch's shallow copy of a module, and the wrapper's training mode.

As upstream, the executor runs a copy of the *top* module only (``copy.copy``): its own
attribute table, hook tables and ``training`` flag, while every submodule, parameter and
buffer is the very object of the user's module. Weights are therefore shared ("changes to
the parameters in the returned model affect the original model and vice versa"), and so
is any state code keeps on submodules: a Lightning module inside the wrapped module keeps
its trainer, attributes set during a call are visible to the user's module.

Submodules being shared, a wrapper's mode (``train`` for ``trainingModel``, ``eval`` for
``inferenceModel``) is applied to the module tree for the duration of each call only
(:class:`TrainingMode`): afterwards every module has its own flag back, so that a training
and an inference wrapper of one module, and the user's module, each keep their mode.
"""
from __future__ import annotations

import copy
from collections.abc import Iterator

import torch

from ..attributes import attribute_table, own_attribute


def shallow_copy_module(module: torch.nn.Module) -> torch.nn.Module:
    """Copy the top module only; submodules, parameters and buffers are shared.

    The copy is a new instance of the module's class holding the same attribute table
    entries. A class's own ``__copy__`` is not used: ``torch.fx.GraphModule`` rebuilds
    itself from its graph there, keeping only the submodules the graph calls and none of
    its hooks, so the copy would no longer have the user's module tree.
    """
    table = attribute_table(module)
    if getattr(type(module), "__copy__", None) is None:
        new = copy.copy(module)  # the instance's attribute table, copied
    else:
        new = object.__new__(type(module))
        torch.nn.Module.__setstate__(new, dict(table))  # (the unpickling protocol)
    for name, value in table.items():
        if "hook" in name and isinstance(value, (dict, list)):
            # per-copy hook tables with the same entries, so that hooks the executor
            # registers on its copy do not reach the user's module
            object.__setattr__(new, name, copy.copy(value))
    return new


class TrainingMode:
    """Puts a module tree in one mode for the duration of a ``with`` block, then gives
    every module its own flag back.

    The modules are listed once, at the first ``with`` (the model as compiled; walking
    the tree costs far more than checking the flags): :meth:`forget` lists them again at
    the next one, as after ``destroy()``. A flag is set with ``object.__setattr__`` (what
    ``nn.Module.__setattr__`` ends up doing for a bool, minus its parameter / buffer /
    submodule checks); a module class with its own ``__setattr__`` gets a real
    ``setattr``."""

    def __init__(self, model: torch.nn.Module, training: bool,
                 keep_eval: list[torch.nn.Module] | None = None) -> None:
        self.model = model
        self.training = training
        # modules left in eval mode by a training wrapper (see PoplarExecutor)
        self._keep = {id(m) for m in keep_eval or ()}
        self._modules: list[torch.nn.Module] | None = None
        self._plain: list[torch.nn.Module] = []  # modules with plain attributes
        self._custom: list[torch.nn.Module] = []  # modules with their own __setattr__
        self._flipped: list[torch.nn.Module] = []
        self._flipped_custom: list[torch.nn.Module] = []

    def forget(self) -> None:
        """List the modules again at the next ``with`` (the tree may have changed)."""
        self._modules = None

    def _list(self) -> None:
        self._modules = [m for m in self.model.modules() if id(m) not in self._keep]
        plain_setattr = torch.nn.Module.__setattr__
        self._plain = [m for m in self._modules if type(m).__setattr__ is plain_setattr
                       and own_attribute(m, "training") is not None]
        plain = {id(m) for m in self._plain}
        self._custom = [m for m in self._modules if id(m) not in plain]

    def __enter__(self) -> None:
        if self._modules is None:
            self._list()
        mode = self.training
        for m in self._plain:  # (a loop that finds none costs less than a list)
            if m.training != mode:
                flipped = [m for m in self._plain if m.training != mode]
                for module in flipped:
                    object.__setattr__(module, "training", mode)
                self._flipped = flipped
                break
        if self._custom:
            self._flipped_custom = [m for m in self._custom if m.training != mode]
            for module in self._flipped_custom:
                module.training = mode

    def __exit__(self, *exc: object) -> None:
        other = not self.training
        if self._flipped:
            for module in self._flipped:
                object.__setattr__(module, "training", other)
            self._flipped = []
        if self._flipped_custom:
            for module in self._flipped_custom:
                module.training = other
            self._flipped_custom = []


def iter_module_pairs(original: torch.nn.Module, copied: torch.nn.Module
                      ) -> Iterator[tuple[torch.nn.Module, torch.nn.Module]]:
    """Yield (original_submodule, copied_submodule) pairs in the copy's
    ``named_modules`` order.

    A module of the copy is paired with the original's module of the same name; one
    the original does not have under that name (a copy that renamed it) is paired with
    itself when the original holds that very module elsewhere. A module the original
    lacks altogether is paired with itself too, and a module of the original the copy
    dropped is not visited: the copy runs without it.
    """
    by_name = dict(original.named_modules(remove_duplicate=False))
    owned = {id(m) for m in by_name.values()}
    for name, sub in copied.named_modules(remove_duplicate=False):
        match = by_name.get(name)
        if match is None or (match is not sub and id(sub) in owned and name):
            match = sub
        yield match, sub
