"""Samplers' ``torch.Generator`` objects made picklable for spawned loader workers:
a generator does not travel to another process through torch's shared-memory pickler,
its state does (``DataLoader.__getstate__``)."""
from __future__ import annotations

import copy

import torch

from .._runtime.attributes import own_attribute

__all__ = ["portable_generators"]


class _GeneratorState:
    """A ``torch.Generator`` as plain bytes: rebuilt into an equal generator (same
    device, same state, so the same shuffled order) when unpickled."""

    def __init__(self, generator: torch.Generator) -> None:
        self.device = str(generator.device)
        self.state = bytes(generator.get_state().numpy().tobytes())

    def __reduce__(self) -> tuple:
        return _rebuild_generator, (self.device, self.state)


def _rebuild_generator(device: str, state: bytes) -> torch.Generator:
    generator = torch.Generator(device=device)
    generator.set_state(torch.frombuffer(bytearray(state), dtype=torch.uint8))
    return generator


_HOLDERS = ("generator", "sampler", "inner", "loader_generator")


def portable_generators(obj: object, portable: dict[int, object], depth: int = 0) -> object:
    """``obj`` (a generator, a sampler holding one, a batch sampler or the resumable
    wrapper around those) with each ``torch.Generator`` replaced by its
    :py:class:`_GeneratorState`. ``portable`` maps ids to replacements, so objects that
    shared a generator (or a sampler) still share it once unpickled."""
    if id(obj) in portable:
        return portable[id(obj)]
    if isinstance(obj, torch.Generator):
        portable[id(obj)] = _GeneratorState(obj)
        return portable[id(obj)]
    if obj is None or depth > 3:
        return obj
    changed = {}
    for key in _HOLDERS:
        value = own_attribute(obj, key)
        new = portable_generators(value, portable, depth + 1)
        if new is not value:
            changed[key] = new
    if not changed:
        return obj
    copied = copy.copy(obj)
    for key, value in changed.items():  # (past DataLoader's refusal of late settings)
        object.__setattr__(copied, key, value)
    portable[id(obj)] = copied
    return copied
