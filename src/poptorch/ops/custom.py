"""Custom ops: ``custom_op`` calls ``torch.library`` ops; its attributes live in
``attributes_lists`` and are read back with ``accessAttributes``."""
from __future__ import annotations

import threading

import torch

from .._logging import info_once
from ..errors import Error

__all__ = ["custom_op", "attributes_lists", "accessAttributes", "ATTR_PREFIX"]

ATTR_PREFIX = "attr:"

#: Every distinct attribute dictionary passed to :func:`custom_op`, in first-use order;
#: ``accessAttributes(ATTR_PREFIX + str(i))`` returns entry ``i``.
attributes_lists: list = []
_attributes_lock = threading.Lock()


def _check_attributes(attributes) -> dict:
    if attributes is None:
        return {}
    if not isinstance(attributes, dict):
        raise Error(f"custom_op: attributes must be a dict, got {type(attributes).__name__}.")
    for key, value in attributes.items():
        if not isinstance(key, str):
            raise Error(f"custom_op: attribute keys must be strings, got {key!r}.")
        values = value if isinstance(value, (list, tuple)) else [value]
        kinds = {float if isinstance(v, float) else int if isinstance(v, int) and
                 not isinstance(v, bool) else str if isinstance(v, str) else None
                 for v in values}
        if None in kinds or len(kinds) > 1:
            raise Error(f"custom_op: attribute {key!r} must be a float, int or str, or a "
                        "list/tuple of only floats, only ints or only strs; got "
                        f"{value!r}.")
    return attributes


def _register_attributes(attributes: dict) -> str:
    """Store ``attributes`` once in ``attributes_lists``; return its id string."""
    with _attributes_lock:
        for index, known in enumerate(attributes_lists):
            if known == attributes:
                return ATTR_PREFIX + str(index)
        attributes_lists.append(dict(attributes))
        return ATTR_PREFIX + str(len(attributes_lists) - 1)


def accessAttributes(attribute_id_str: str) -> dict:
    """The attribute dictionary of a custom op, from its id string (``"attr:<n>"``)."""
    if not isinstance(attribute_id_str, str) or not attribute_id_str.startswith(ATTR_PREFIX):
        raise Error(f"accessAttributes: expected an id of the form '{ATTR_PREFIX}<n>', got "
                    f"{attribute_id_str!r}.")
    try:
        return attributes_lists[int(attribute_id_str[len(ATTR_PREFIX):])]
    except (ValueError, IndexError):
        raise Error(f"accessAttributes: no custom op attributes with id "
                    f"{attribute_id_str!r}.") from None


def _resolve(name: str, domain: str):
    """``torch.ops.<domain>.<name>``; dots in the domain become underscores."""
    namespaces = [domain] + ([domain.replace(".", "_")] if "." in domain else [])
    for namespace in namespaces:
        try:
            return getattr(getattr(torch.ops, namespace), name)
        except (AttributeError, RuntimeError):
            continue
    tried = " or ".join(f"torch.ops.{n}.{name}" for n in namespaces)
    raise Error(f"custom_op: no operator {tried}. Define it with torch.library (for example "
                f"torch.library.custom_op('{namespaces[-1]}::{name}', ...)) or load the "
                "shared library that registers it with torch.ops.load_library(path) first.")


def custom_op(inputs, name: str, domain: str, domain_version: int, example_outputs,
              attributes=None) -> list:
    """Call the ``torch.library`` operator ``torch.ops.<domain>.<name>``.

    Upstream this ran a PopART C++ op; here a custom op is any operator registered with
    ``torch.library`` (in Python, or in C++ and loaded with ``torch.ops.load_library``).
    A domain containing dots (``"com.acme"``) is looked up with underscores
    (``torch.ops.com_acme``). The op is called with the ``inputs`` as positional
    arguments and the ``attributes`` as keyword arguments; its outputs must match
    ``example_outputs`` in number, shape and dtype. ``domain_version`` is recorded only
    (torch.library has no op versions). Returns the outputs as a list.
    """
    if isinstance(inputs, torch.Tensor):
        inputs = [inputs]
    if not isinstance(inputs, (list, tuple)):
        raise Error(f"custom_op: inputs must be a tuple or list of tensors, got "
                    f"{type(inputs).__name__}.")
    if not isinstance(name, str) or not isinstance(domain, str) or not name or not domain:
        raise Error("custom_op: name and domain must be non-empty strings.")
    if isinstance(domain_version, bool) or not isinstance(domain_version, int):
        raise Error(f"custom_op: domain_version must be an int, got {domain_version!r}.")
    if isinstance(example_outputs, torch.Tensor):
        example_outputs = [example_outputs]
    if not isinstance(example_outputs, (list, tuple)) or \
            not all(isinstance(t, torch.Tensor) for t in example_outputs):
        raise Error("custom_op: example_outputs must be a tuple or list of tensors.")
    attributes = _check_attributes(attributes)
    if attributes:
        _register_attributes(attributes)
    info_once("custom_op.domain_version", "poptorch.custom_op: domain_version is recorded "
                                          "only; torch.library operators have no versions.")
    operator = _resolve(name, domain)
    outputs = operator(*inputs, **attributes)
    outputs = [outputs] if isinstance(outputs, torch.Tensor) else list(outputs)
    if len(outputs) != len(example_outputs):
        raise Error(f"custom_op: {domain}::{name} returned {len(outputs)} outputs but "
                    f"example_outputs lists {len(example_outputs)}.")
    for index, (out, example) in enumerate(zip(outputs, example_outputs)):
        if not isinstance(out, torch.Tensor) or out.shape != example.shape \
                or out.dtype != example.dtype:
            got = (f"shape {tuple(out.shape)} and dtype {out.dtype}"
                   if isinstance(out, torch.Tensor) else type(out).__name__)
            raise Error(f"custom_op: output {index} of {domain}::{name} has {got}, but "
                        f"example_outputs[{index}] has shape {tuple(example.shape)} and "
                        f"dtype {example.dtype}.")
    return outputs
