"""Dict-like output classes as pytree nodes.

Outputs are detached, gathered over micro-batches and moved to the host with
``torch.utils._pytree``, which treats an unregistered ``Mapping`` subclass (Hugging Face's
``ModelOutput`` before transformers registered it itself, an ``OrderedDict`` subclass...)
as one opaque leaf: its tensors would not be detached, moved or concatenated. The first
time such a class shows up in an output it is registered as a node whose children are its
values, rebuilt with ``cls(**items)`` (dataclass-style constructors, ``ModelOutput``) or
``cls(items)`` (dict-style constructors).
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import cast

from ..._typing import UserOutput
from ..torch_internals import pytree

__all__ = ["register_mapping_outputs"]

_checked: set = set()


def register_mapping_outputs(output: object) -> None:
    """Register every ``Mapping`` subclass found in ``output`` that pytree does not know."""
    if isinstance(output, Mapping):
        cls = type(output)
        if cls not in _checked:
            _checked.add(cls)
            if cls not in pytree.SUPPORTED_NODES:
                _register(cls)
        values: Iterable[object] = output.values()
    elif isinstance(output, (tuple, list)):
        values = output
    else:
        return
    for value in values:
        register_mapping_outputs(value)


def _register(cls: type) -> None:
    def flatten(mapping: Mapping[object, UserOutput]) -> tuple[list[UserOutput], list[object]]:
        return list(mapping.values()), list(mapping.keys())

    def unflatten(values: Iterable[UserOutput], keys: list[object]) -> Mapping[object, UserOutput]:
        items = dict(zip(keys, values, strict=False))
        try:
            return cls(**cast("dict[str, UserOutput]", items))  # (other keys: TypeError)
        except TypeError:
            return cls(items)

    pytree.register_pytree_node(cls, flatten, unflatten,
                                serialized_type_name=f"{cls.__module__}.{cls.__qualname__}")
