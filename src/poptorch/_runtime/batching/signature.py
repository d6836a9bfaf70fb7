"""The input signature a model was compiled for, and the check of every later call.

As in PopTorch, a compiled model accepts only inputs like those it was compiled with:
the same number of positional arguments, the same argument names (dictionary keys
included), and per argument the same nesting, tensor dtypes and shapes, and the same
non-tensor values (PopTorch compiles those in as constants). Anything else raises
:py:class:`poptorch.Error` *before* the model runs, naming the argument, what was
expected and what was given, and showing both signatures; ``destroy()`` lets the
model compile again for new inputs.

Checking costs about a microsecond per argument in the common case (positional tensor
arguments only); other calls bind the arguments to ``forward``'s signature first.
"""
from __future__ import annotations

import inspect
from collections.abc import Callable, Hashable
from typing import Any

import torch

from ...errors import Error


def _describe(value: Any) -> Any:
    """A comparable description of one argument."""
    if isinstance(value, torch.Tensor):
        return ("tensor", value.dtype, tuple(value.shape))
    if isinstance(value, dict):
        return ("dict", {k: _describe(v) for k, v in value.items()})
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, [_describe(v) for v in value])
    if value is None or isinstance(value, (bool, int, float, complex, str, bytes)):
        return ("value", value)
    # Other objects (custom argument classes, ...): only their type is part of the
    # signature; their tensors are not inputs the compiled program can see.
    return ("object", type(value))


def _show(desc: Any) -> str:
    kind = desc[0]
    if kind == "tensor":
        return f"Tensor[{desc[1]!s}, {torch.Size(desc[2])}]"
    if kind == "dict":
        return "{" + ", ".join(f"{k!r}: {_show(v)}" for k, v in desc[1].items()) + "}"
    if kind in ("list", "tuple"):
        inner = ", ".join(_show(v) for v in desc[1])
        return f"[{inner}]" if kind == "list" else f"({inner})"
    if kind == "object":
        return f"<{desc[1].__name__}>"
    return repr(desc[1])


def _kind_name(desc: Any) -> str:
    kind = desc[0]
    if kind == "tensor":
        return "torch.Tensor"
    if kind == "object":
        return desc[1].__name__
    if kind == "value":
        return type(desc[1]).__name__ if desc[1] is not None else "None"
    return kind


def _same_value(a: object, b: object) -> bool:
    if a is b:
        return True
    try:
        return bool(type(a) is type(b) and a == b)
    except Exception:
        return False


def _compare(path: str, old: Any, new: Any) -> str | None:
    """The first difference between two descriptions, as a message; None if equal."""
    if old[0] != new[0]:
        return (f"Type mismatch for {path}: expected {_kind_name(old)} but got "
                f"{_kind_name(new)}")
    kind = old[0]
    if kind == "tensor":
        if old[1] != new[1]:
            return f"Dtype mismatch for {path}: expected {old[1]} but got {new[1]}"
        if old[2] != new[2]:
            return (f"Shape mismatch for {path}: expected {torch.Size(old[2])} but got "
                    f"{torch.Size(new[2])}")
        return None
    if kind == "dict":
        missing = [k for k in old[1] if k not in new[1]]
        extra = [k for k in new[1] if k not in old[1]]
        if missing:
            return f"Missing arguments: {', '.join(map(str, missing))}. (in {path})"
        if extra:
            return f"Unexpected arguments: {', '.join(map(str, extra))}. (in {path})"
        for key, value in old[1].items():
            diff = _compare(f"{path}[{key!r}]", value, new[1][key])
            if diff:
                return diff
        return None
    if kind == "object":
        if old[1] is not new[1]:
            return (f"Type mismatch for {path}: expected {old[1].__name__} but got "
                    f"{new[1].__name__}")
        return None
    if kind in ("list", "tuple"):
        if len(old[1]) != len(new[1]):
            return (f"Structure mismatch for {path}: expected a {kind} of {len(old[1])} "
                    f"elements but got {len(new[1])}")
        for i, (a, b) in enumerate(zip(old[1], new[1], strict=False)):
            diff = _compare(f"{path}[{i}]", a, b)
            if diff:
                return diff
        return None
    if not _same_value(old[1], new[1]):
        return f"Value mismatch for {path}: expected {old[1]!r} but got {new[1]!r}"
    return None


class InputSignature:
    """What one compiled model accepts (see module docstring)."""

    def __init__(self, forward: Callable, args: tuple, kwargs: dict) -> None:
        try:
            self._signature: inspect.Signature | None = inspect.signature(forward)
        except (TypeError, ValueError):
            self._signature = None
        self._positional = len(args)
        # The number of positional arguments matters only where binding does not fix
        # it: with *args, or when forward's signature is unknown.
        self._count_positional = self._signature is None or any(
            p.kind is inspect.Parameter.VAR_POSITIONAL
            for p in self._signature.parameters.values())
        if self._signature is not None:
            self._check_mandatory(args, kwargs)
        self._fast = None
        if not kwargs and all(isinstance(a, torch.Tensor) for a in args):
            self._fast = tuple((a.dtype, a.shape) for a in args)
        self._named = self._bind(args, kwargs)

    def _check_mandatory(self, args: tuple, kwargs: dict) -> None:
        """PopTorch names a missing mandatory argument at compile time."""
        assert self._signature is not None  # (checked by the caller)
        try:
            self._signature.bind(*args, **kwargs)
        except TypeError as error:
            text = str(error)
            if "missing a required argument" in text:
                name = text.rsplit(":", 1)[-1].strip().strip("'")
                raise Error(f"Mandatory parameter {name} missing: forward{self._signature}"
                            f" needs it; pass it when calling the model.") from None
            self._signature = None  # cannot bind: compare positions and keywords
            self._count_positional = True

    def _bind(self, args: tuple, kwargs: dict) -> dict[str, Any]:
        """``{argument name: description}``, defaults included when known."""
        named: dict[str, Any] = {}
        bound = None
        signature = self._signature
        if signature is not None:
            try:
                bound = signature.bind(*args, **kwargs)
                bound.apply_defaults()
            except TypeError:
                bound = None
        if bound is None or signature is None:
            named.update({f"args[{i}]": _describe(a) for i, a in enumerate(args)})
            named["kwargs"] = _describe(dict(kwargs))
            return named
        for name, value in bound.arguments.items():
            kind = signature.parameters[name].kind
            if kind is inspect.Parameter.VAR_KEYWORD:
                named["**" + name] = _describe(dict(value))
            else:
                named[name] = _describe(value)
        return named

    def fingerprint(self) -> tuple | None:
        """``((dtype, shape), ...)`` of the compiled inputs when they are positional
        tensors only (the case a call can be checked by comparing these); else None."""
        return self._fast

    def check(self, args: tuple, kwargs: dict) -> None:
        """Raise :py:class:`poptorch.Error` if this call's inputs differ."""
        fast = self._fast
        if fast is not None and not kwargs and len(args) == len(fast):
            for arg, (dtype, shape) in zip(args, fast, strict=False):
                if not isinstance(arg, torch.Tensor) or arg.dtype != dtype \
                        or arg.shape != shape:
                    break
            else:
                return
        if self._count_positional and len(args) != self._positional:
            self._fail(f"Number of positional arguments mismatch: expected "
                       f"{self._positional} arguments but got {len(args)}", args, kwargs)
        named = self._bind(args, kwargs)
        missing = [n for n in self._named if n not in named]
        extra = [n for n in named if n not in self._named]
        if missing:
            self._fail(f"Missing arguments: {', '.join(missing)}.", args, kwargs)
        if extra:
            self._fail(f"Unexpected arguments: {', '.join(extra)}.", args, kwargs)
        for name, old in self._named.items():
            new = named[name]
            if name.startswith("**"):
                missing = [k for k in old[1] if k not in new[1]]
                extra = [k for k in new[1] if k not in old[1]]
                if missing:
                    self._fail(f"Missing arguments: {', '.join(missing)}.", args, kwargs)
                if extra:
                    self._fail(f"Unexpected arguments: {', '.join(extra)}.", args, kwargs)
                for key, value in old[1].items():
                    diff = _compare(key, value, new[1][key])
                    if diff:
                        self._fail(diff, args, kwargs)
                continue
            diff = _compare(name, old, new)
            if diff:
                self._fail(diff, args, kwargs)

    def _show_named(self, named: dict[str, Any]) -> str:
        return "(" + ", ".join(f"{n}={_show(d)}" for n, d in named.items()) + ")"

    def _fail(self, reason: str, args: tuple, kwargs: dict) -> None:
        raise Error(
            f"{reason.rstrip('.')}. The model was compiled for the inputs "
            f"{self._show_named(self._named)} and was called with "
            f"{self._show_named(self._bind(args, kwargs))}. A compiled model only "
            "accepts inputs of the same structure, dtypes and shapes (and the same "
            "non-tensor values): call destroy() on it first to compile it again for "
            "the new inputs, or wrap the model again.")


def detach_inputs(args: tuple, kwargs: dict, warn_key: Hashable = None) -> tuple[tuple, dict]:
    """Inputs that require grad are detached, as in PopTorch: the device program does
    not back-propagate into its inputs (a graph attached to an input, e.g. a hidden state
    computed by an earlier step, would otherwise be walked again). Logged once per
    ``warn_key`` (the executor passes its own: once per model, as PopTorch warns when it
    compiles)."""
    if not kwargs and all(isinstance(a, torch.Tensor) and not a.requires_grad
                          for a in args):
        return args, kwargs  # the common case: nothing to do
    from ..torch_internals import pytree
    leaves, spec = pytree.tree_flatten((args, kwargs))
    if not any(isinstance(t, torch.Tensor) and t.requires_grad for t in leaves):
        return args, kwargs
    import logging

    from ..._logging import log_once
    log_once(logging.WARNING, ("input requires grad", warn_key),
             "Input tensor has requires_grad=True set. This tensor will be detached "
             "because backward pass via inputs is not supported.")
    leaves = [t.detach() if isinstance(t, torch.Tensor) and t.requires_grad else t
              for t in leaves]
    return pytree.tree_unflatten(leaves, spec)
