"""PopTorch's shallow copy of a module.

The executor runs its own copy of the user's module tree: every module object is new
(so flags such as ``training`` and hook tables are per-copy), while every parameter and
buffer is the very same tensor object as in the user's module, so that weights are shared
("changes to the parameters in the returned model affect the original model and vice
versa").
"""
from __future__ import annotations

import copy

import torch


def shallow_copy_module(module: torch.nn.Module) -> torch.nn.Module:
    """Copy the module tree, sharing parameters and buffers (see module docstring)."""
    return _copy(module, {})


def _copy(module: torch.nn.Module, memo: dict) -> torch.nn.Module:
    if id(module) in memo:  # a submodule used in several places stays shared
        return memo[id(module)]
    new = copy.copy(module)
    memo[id(module)] = new
    for name, value in vars(module).items():
        if isinstance(value, (dict, set, list)) and name.startswith("_"):
            setattr(new, name, copy.copy(value))  # per-copy tables (params, hooks...)
    new._modules = {name: None if child is None else _copy(child, memo)
                    for name, child in module._modules.items()}
    return new


def iter_module_pairs(original: torch.nn.Module, copied: torch.nn.Module):
    """Yield (original_submodule, copied_submodule) pairs in ``named_modules`` order."""
    copies = dict(copied.named_modules(remove_duplicate=False))
    for name, sub in original.named_modules(remove_duplicate=False):
        yield sub, copies[name]
