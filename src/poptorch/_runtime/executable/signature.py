"""The input signature of a compiled program: the structure of the call's arguments and
each tensor's shape and dtype.

A precompiled program (``compileAndExport`` / ``poptorch.load``) only runs the inputs
it was compiled for, as PopTorch's executables do: :py:meth:`InputSignature.check`
raises :py:class:`poptorch.Error` naming the first input that differs. The signature is
also part of the executable-cache key.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any, cast

import torch

from ...errors import Error
from ..torch_internals import pytree


def _describe(leaf: object) -> tuple:
    if isinstance(leaf, torch.Tensor):
        return ("tensor", tuple(leaf.shape), str(leaf.dtype).replace("torch.", ""))
    if leaf is None or isinstance(leaf, (bool, int, float, str)):
        return ("value", type(leaf).__name__, leaf)
    return ("object", type(leaf).__qualname__)


def _paths(spec: pytree.TreeSpec) -> list[str]:
    """Readable names of the leaves: ``input 0``, ``input 1[2]``, ``input 'mask'``."""
    dummy = pytree.tree_unflatten(list(range(spec.num_leaves)), spec)
    paths, _ = pytree.tree_flatten_with_path(dummy)
    names = []
    for keys, _ in paths:
        # keys[0] selects args (0) or kwargs (1); keys[1] the argument
        head, rest = keys[1:2], keys[2:]
        if not head:
            names.append("input")
            continue
        key: Any = head[0]  # a SequenceKey (.idx) or MappingKey (.key): read as either
        first = cast(pytree.SequenceKey, keys[0])
        base = (f"input {key.idx}" if first.idx == 0 else f"input {key.key!r}") \
            if hasattr(key, "idx") or hasattr(key, "key") else f"input {key}"
        names.append(base + "".join(str(k) for k in rest))
    return names


class InputSignature:
    """What a compiled program accepts (module docstring)."""

    def __init__(self, spec: str, leaves: list[tuple]) -> None:
        self.spec = spec
        self.leaves = leaves

    @classmethod
    def of(cls, args: tuple, kwargs: dict) -> InputSignature:
        """The signature of a call ``f(*args, **kwargs)``."""
        leaves, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
        return cls(str(spec), [_describe(leaf) for leaf in leaves])

    def key(self) -> str:
        """A stable text form (for cache keys)."""
        return repr((self.spec, self.leaves))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, InputSignature) and self.key() == other.key()

    def __hash__(self) -> int:
        return hash(self.key())

    def check(self, args: tuple, kwargs: dict) -> None:
        """Raise :py:class:`poptorch.Error` unless the call's inputs match."""
        leaves, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
        if str(spec) != self.spec or len(leaves) != len(self.leaves):
            raise Error(
                "The inputs do not match the precompiled executable: it was compiled for "
                f"{self._summary(self.leaves)} and got {self._summary(map(_describe, leaves))}"
                ". A precompiled model runs only the inputs it was exported with; wrap "
                "the model again (poptorch.trainingModel / inferenceModel) to compile "
                "for other inputs.")
        names = None
        for n, (leaf, expected) in enumerate(zip(leaves, self.leaves, strict=False)):
            got = _describe(leaf)
            if got != expected:
                names = names or _paths(spec)
                raise Error(
                    f"The inputs do not match the precompiled executable: {names[n]} is "
                    f"{self._one(got)} but the executable was compiled for "
                    f"{self._one(expected)}. A precompiled model runs only the inputs it "
                    "was exported with; wrap the model again (poptorch.trainingModel / "
                    "inferenceModel) to compile for other inputs.")

    @staticmethod
    def _one(leaf: tuple) -> str:
        if leaf[0] == "tensor":
            return f"a {leaf[2]} tensor of shape {list(leaf[1])}"
        if leaf[0] == "value":
            return f"the value {leaf[2]!r}"
        return f"a {leaf[1]}"

    @classmethod
    def _summary(cls, leaves: Iterable[tuple]) -> str:
        return "(" + ", ".join(cls._one(leaf) for leaf in leaves) + ")"

    def __getstate__(self) -> dict:
        return {"spec": self.spec, "leaves": self.leaves}

    def __setstate__(self, state: dict) -> None:
        self.spec, self.leaves = state["spec"], state["leaves"]
