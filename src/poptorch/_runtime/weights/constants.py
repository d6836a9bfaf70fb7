"""Plain tensor attributes of a module: constants of the compiled program.

PopTorch compiles a tensor that is a module attribute but neither a parameter nor a
buffer (``self.i = torch.tensor([0.])``) into the program as a constant. The first call
(PopTorch's trace) runs on the user's tensor, so in-place changes made by ``forward``
show there once; every later call starts again from the value the tensor had when the
model was compiled, and the user's tensor is left alone. To keep state across calls,
register a buffer (``register_buffer``).

``TensorConstants`` records those tensors at compile time and, before each later call,
puts back a fresh copy of any that was changed in place or replaced (it compares the
tensor's identity and version counter, so untouched constants cost nothing).
"""
from __future__ import annotations

import torch

from ..attributes import attribute_table


class TensorConstants:
    """The plain tensor attributes of a (device) module tree (see module docstring)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._entries: list[list] = []
        for module in model.modules():
            for name, value in attribute_table(module).items():
                if isinstance(value, torch.Tensor) and not value.requires_grad \
                        and not isinstance(value, torch.nn.Parameter):
                    snapshot = value.detach().clone()
                    self._entries.append([module, name, snapshot, value, value._version])

    def __bool__(self) -> bool:
        return bool(self._entries)

    def restore(self) -> None:
        """Give every changed constant its compile-time value again (a new tensor)."""
        obj: torch.Tensor  # (the constant the module held at the last restore)
        for entry in self._entries:
            module, name, snapshot, obj, version = entry
            current = getattr(module, name, None)
            if current is obj and obj._version == version:
                continue
            fresh = snapshot.clone()
            setattr(module, name, fresh)
            entry[3], entry[4] = fresh, fresh._version
