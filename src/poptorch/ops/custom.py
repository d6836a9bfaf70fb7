"""Custom ops: ``custom_op`` calls ``torch.library`` ops; its attributes live in
``attributes_lists`` and are read back with ``accessAttributes``."""
from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Protocol

import torch

from .._logging import info_once
from .._runtime.torch_internals import (
    disable_dynamo,
    dispatch_get_all_op_names,
    dispatch_has_kernel_for_dispatch_key,
    fake_impl_entry,
)
from .._typing import UserInput
from ..errors import Error, PoptorchValueError

__all__ = ["ATTR_PREFIX", "accessAttributes", "attributes_lists", "custom_op"]

ATTR_PREFIX = "attr:"

#: Every distinct attribute dictionary passed to :func:`custom_op`, in first-use order;
#: ``accessAttributes(ATTR_PREFIX + str(i))`` returns entry ``i``.
attributes_lists: list = []
_attributes_lock = threading.Lock()


def _check_attributes(attributes: object) -> dict:
    if attributes is None:
        return {}
    if not isinstance(attributes, dict):
        raise Error(f"custom_op: attributes must be a dict, got {type(attributes).__name__}.")
    for key, value in attributes.items():
        if not isinstance(key, str):
            raise PoptorchValueError(f"custom_op: attribute keys must be strings, got {key!r}.")
        values = value if isinstance(value, (list, tuple)) else [value]
        kinds = {float if isinstance(v, float) else int if isinstance(v, int) and
                 not isinstance(v, bool) else str if isinstance(v, str) else None
                 for v in values}
        if None in kinds or len(kinds) > 1:
            raise PoptorchValueError(
                f"custom_op: attribute {key!r} must be a float, int or str, or a "
                f"list/tuple of only floats, only ints or only strs; got {value!r}.")
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


def _registered(namespace: str) -> list[str]:
    """Names of the operators registered under ``namespace`` (C++ or Python)."""
    prefix = namespace + "::"
    return sorted({n[len(prefix):].split(".")[0] for n in dispatch_get_all_op_names()
                   if n.startswith(prefix)})


class _Schema(Protocol):
    @property
    def returns(self) -> Sequence[object]: ...


class _Overload(Protocol):
    @property
    def _schema(self) -> _Schema: ...


class Operator(Protocol):
    """``torch.ops.<namespace>.<name>``: an operator packet, as custom_op reads and calls
    it (its qualified name, overloads and default overload's schema)."""

    @property
    def _qualified_op_name(self) -> str: ...
    @property
    def default(self) -> _Overload: ...
    def overloads(self) -> list[str]: ...
    def __call__(self, *args: object, **kwargs: object
                 ) -> torch.Tensor | tuple[torch.Tensor, ...]: ...


def _resolve(name: str, domain: str) -> Operator:
    """``torch.ops.<domain>.<name>`` (an operator packet, found by name); dots in the
    domain become underscores (a torch namespace cannot contain dots)."""
    namespace = domain.replace(".", "_")
    try:
        return getattr(getattr(torch.ops, namespace), name)
    except (AttributeError, RuntimeError):
        pass
    known = _registered(namespace)
    if known:
        raise Error(f"custom_op: domain '{domain}' (torch.ops.{namespace}) has no "
                    f"operator '{name}'; it has: {', '.join(known)}. Check the name "
                    "(it is case-sensitive).")
    raise Error(f"custom_op: no operator '{name}' in domain '{domain}': nothing is "
                f"registered under torch.ops.{namespace}. Load the shared library "
                "that defines it first (ctypes.cdll.LoadLibrary(path) or "
                "torch.ops.load_library(path)), or define it with torch.library (for "
                f"example torch.library.custom_op('{namespace}::{name}', ...)).")


_fake_registered: set = set()
_fake_lock = threading.Lock()
#: Operators whose kernel returned dtypes other than example_outputs' in an eager call
#: (qualified name -> the dtypes returned), read by the fake kernels made here.
_returned_dtypes: dict[str, list[torch.dtype]] = {}
#: Operators whose fake kernel is made here: it returns the shapes of the first call's
#: example_outputs, so a traced call's shapes are checked only against an op's own.
_made_fakes: set = set()


def _has_fake(qualname: str) -> bool:
    if dispatch_has_kernel_for_dispatch_key(qualname, "Meta"):
        return True
    entry = fake_impl_entry(qualname)
    return entry.fake_impl.kernel is not None


def _ensure_shape_inference(operator: Operator, example_outputs: list[torch.Tensor]) -> None:
    """Give an operator without a fake (meta) kernel one built from ``example_outputs``
    (their shapes and dtypes), so that compiled backends (torch.compile, torch.export)
    can trace it: upstream likewise took output shapes from ``example_outputs``."""
    qualname = operator._qualified_op_name
    with _fake_lock:
        if qualname in _fake_registered:
            return
        _fake_registered.add(qualname)  # checked (its own fake kernel, or ours below)
        if "default" not in operator.overloads() or _has_fake(qualname):
            return
        specs = [(tuple(e.shape), e.dtype) for e in example_outputs]
        single = len(operator.default._schema.returns) == 1

        def fake(*args: object, **kwargs: object) -> torch.Tensor | tuple[torch.Tensor, ...]:
            device = next((a.device for a in args if isinstance(a, torch.Tensor)), None)
            # the dtypes the kernel was seen to return, where an eager call differed
            # from example_outputs: a traced graph then holds the conversion too
            dtypes = _returned_dtypes.get(qualname, [dtype for _, dtype in specs])
            outs = tuple(torch.empty(shape, dtype=dtype, device=device)
                         for (shape, _), dtype in zip(specs, dtypes, strict=True))
            return outs[0] if single else outs

        torch.library.register_fake(qualname, fake)
        _made_fakes.add(qualname)


def _record(operator: Operator, attributes: dict, example_outputs: list[torch.Tensor]) -> None:
    """Bookkeeping of a call: its attributes (``accessAttributes``), the one-time log
    and the operator's shape inference."""
    if attributes:
        _register_attributes(attributes)
    info_once("custom_op.domain_version", "poptorch.custom_op: domain_version is recorded "
                                          "only; torch.library operators have no versions.")
    _ensure_shape_inference(operator, example_outputs)


# Bookkeeping is a side effect torch.compile cannot trace: inside a compiled region it
# runs eagerly, and only at the operator's first use (one graph break). torch's lazy form
# of ``torch._dynamo.disable``: importing torch._dynamo up front would double the time
# ``import poptorch`` takes.
_record_eagerly = disable_dynamo(_record)


def _follow_examples(outputs: list[torch.Tensor], example_outputs: list[torch.Tensor],
                     qualname: str, label: str) -> list[torch.Tensor]:
    """The op's outputs as ``example_outputs`` declare them (upstream built a custom op's
    outputs from them): a different dtype is converted (logged once at INFO), a
    different number or shape of outputs is an error naming both."""
    if len(outputs) != len(example_outputs):
        raise Error(f"custom_op: {label} returned {len(outputs)} outputs but "
                    f"example_outputs lists {len(example_outputs)}.")
    compiling = torch.compiler.is_compiling()
    converted: list[torch.Tensor] = []
    for index, (out, example) in enumerate(zip(outputs, example_outputs, strict=True)):
        if not isinstance(out, torch.Tensor):
            raise Error(f"custom_op: output {index} of {label} is a "
                        f"{type(out).__name__}, but example_outputs[{index}] is a tensor "
                        f"of shape {tuple(example.shape)}.")
        if (not compiling or qualname not in _made_fakes) and out.shape != example.shape:
            raise Error(f"custom_op: output {index} of {label} has shape "
                        f"{tuple(out.shape)}, but example_outputs[{index}] has shape "
                        f"{tuple(example.shape)}: the op must return the shapes that "
                        "example_outputs declare.")
        if out.dtype != example.dtype:
            if not compiling:
                _returned_dtypes[qualname] = [o.dtype for o in outputs]
                info_once(("custom_op.dtype", label, index),
                          "poptorch.custom_op: output %d of %s is %s; converted to %s, the "
                          "dtype of example_outputs[%d] (the declared type, as upstream).",
                          index, label, out.dtype, example.dtype, index)
            out = out.to(example.dtype)
        converted.append(out)
    return converted


def custom_op(inputs: torch.Tensor | list[torch.Tensor] | tuple[torch.Tensor, ...],
              name: str, domain: str, domain_version: int,
              example_outputs: torch.Tensor | list[torch.Tensor] | tuple[torch.Tensor, ...],
              attributes: dict[str, UserInput] | None = None) -> list[torch.Tensor]:
    """Call the ``torch.library`` operator ``torch.ops.<domain>.<name>``.

    Upstream this ran a PopART C++ op; here a custom op is any operator registered with
    ``torch.library`` (in Python, or in C++ and loaded with ``torch.ops.load_library``).
    A domain containing dots (``"com.acme"``) is looked up with underscores
    (``torch.ops.com_acme``). The op is called with the ``inputs`` as positional
    arguments and the ``attributes`` as keyword arguments. Its outputs follow
    ``example_outputs``, their declared types, as upstream's did: an output of another
    dtype is converted to the example's (logged once at INFO); a different number or
    shape of outputs raises :class:`poptorch.Error` naming both. An operator without a
    fake (meta) kernel gets one from ``example_outputs``, so compiled backends can
    trace it.
    ``domain_version`` is recorded only
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
    operator = _resolve(name, domain)
    if not torch.compiler.is_compiling():
        _record(operator, attributes, list(example_outputs))
    elif operator._qualified_op_name not in _fake_registered:
        _record_eagerly(operator, attributes, list(example_outputs))
    returned = operator(*inputs, **attributes)
    outputs = [returned] if isinstance(returned, torch.Tensor) else list(returned)
    return _follow_examples(outputs, list(example_outputs), operator._qualified_op_name,
                            f"{domain}::{name}")
