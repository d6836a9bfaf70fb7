"""PopTorch's placement rules for ``set_overlap_for_input`` / ``set_overlap_for_output``.

The overlap itself has no meaning on CPUs and GPUs (the markers only record their hint),
but PopTorch refuses misplaced markers when it compiles a model, and so do we, at the
first call (the compiling one), before any weight changes:

1. ``set_overlap_for_input`` must be applied to tensors the model's ``forward`` received
   (also inside tuples, lists and dicts);
2. it must be the only op applied to such an input: no other op (before or after the
   marking) may use the raw input, nor may it be marked twice or returned as it is;
3. the result of ``set_overlap_for_output`` must be returned by the model (anywhere in
   its output structure); other ops may use it too;
4. a marked output must not be returned twice (also through the unmarked tensor or in
   nested tuples / lists);
5. once a marker asks for an overlap (any mode but ``NoOverlap``), the options must
   allow overlapped IO as on an IPU: not ``PipelinedExecution`` (the default strategy),
   ``TensorLocations.numIOTiles`` set, output mode ``All`` or ``Sum``.

:class:`OverlapCheck` installs itself on the executor's copy of the model for one call:
the first ``forward`` of that call runs under a :class:`~torch.overrides.TorchFunctionMode`
that records which ops consume the raw input tensors, and the markers (through
``context.overlap_checker()``) return an alias (``view_as``: same storage, same values,
autograd intact) of what they mark so that uses of the marked tensor can be told from uses
of the raw one. The rules are checked when that forward returns. Later forwards and later
calls run the plain markers, which return their arguments: no cost after compiling.
"""
from __future__ import annotations

import inspect
import sys
import threading
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.overrides import TorchFunctionMode, resolve_name
from ..torch_internals import DisableTorchFunction, dynamo, pytree

from .. import context
from ...enums import OutputMode, OverlapMode
from ...errors import Error

__all__ = ["OverlapCheck", "OverlapSettings"]

_INPUT_NOT_INPUT = ("poptorch.set_overlap_for_input applied on a node which is not a "
                    "tensor input to the model.")
_ONLY_OP = ("poptorch.set_overlap_for_input must be the only op applied to an input. "
            "This is not the case for input {n} to the model.")
_OUTPUT_NOT_OUTPUT = ("poptorch.set_overlap_for_output applied on a node which is not a "
                      "tensor output to the model.")
_RETURNED_TWICE = ("poptorch.set_overlap_for_output cannot be used with a tensor that is "
                   "returned twice. Please check all returned tensors including those "
                   "nested in tuples/lists.")
_PIPELINED = ("Overlapped IO is not supported with poptorch.PipelinedExecution. If you "
              "are using only one IPU, please switch to poptorch.ShardedExecution.")
_NO_IO_TILES = ("No IO tiles allocated. You must allocate at least 32 IO tiles using "
                "poptorch.Options().TensorLocations.numIOTiles.")
_OUTPUT_MODE = ("Unsupported output mode for overlapped IO. Please switch output mode to "
                "poptorch.OutputMode.All or poptorch.OutputMode.Sum.")


def _metadata_functions() -> frozenset:
    """Tensor functions that read metadata only: not ops on the tensor's values (PopTorch
    traces no op for them), so they do not count as uses of a raw input."""
    props = ("shape", "dtype", "device", "requires_grad", "ndim", "layout", "is_cuda",
             "is_sparse", "is_quantized", "is_meta", "grad_fn", "is_leaf", "names", "grad")
    methods = ("size", "dim", "ndimension", "numel", "nelement", "is_floating_point",
               "is_complex", "stride", "storage_offset", "is_contiguous", "element_size",
               "get_device", "data_ptr", "__len__", "__repr__", "__format__", "__hash__")
    found = [getattr(torch.Tensor, p).__get__ for p in props if hasattr(torch.Tensor, p)]
    found += [getattr(torch.Tensor, m) for m in methods if hasattr(torch.Tensor, m)]
    return frozenset(found)


_METADATA = _metadata_functions()


@dataclass(frozen=True)
class OverlapSettings:
    """The options rule 5 reads (module docstring)."""
    pipelined: bool
    io_tiles: int
    output_mode: OutputMode


def _alias(tensor: torch.Tensor) -> torch.Tensor:
    """A new tensor object viewing ``tensor`` (same storage and values, differentiable),
    made outside every torch function mode so that no mode sees the marker as an op."""
    with DisableTorchFunction():
        return tensor.view_as(tensor)


class _ForwardRecord(TorchFunctionMode):
    """What one forward did with its inputs and markers (module docstring)."""

    def __init__(self, inputs: list[torch.Tensor], names: list[str]) -> None:
        super().__init__()
        self.inputs = inputs  # kept alive: their ids stay theirs during the forward
        self.index: dict[int, int] = {}
        for n, t in enumerate(inputs):
            self.index.setdefault(id(t), n)
        self.names = names
        self.uses: dict[int, list[str]] = {}    # input index -> ops using it raw
        self.marked: dict[int, int] = {}        # input index -> times marked
        self.misplaced: list[tuple[int, str]] = []  # (call order, message)
        self.outputs: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # order, raw, alias
        self.root: dict[int, torch.Tensor] = {}  # id(alias of a marked output) -> raw
        self.overlapping = False
        self._calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in _METADATA:
            for leaf in pytree.tree_leaves((args, kwargs)):
                if isinstance(leaf, torch.Tensor):
                    n = self.index.get(id(leaf))
                    if n is not None and leaf is self.inputs[n]:
                        self.uses.setdefault(n, []).append(resolve_name(func) or
                                                           getattr(func, "__name__", "?"))
        return func(*args, **kwargs)

    # the markers (ops/hints.py) call these while this forward runs
    def mark_input(self, structure: Any, mode: OverlapMode) -> Any:
        self._calls += 1

        def mark(t: torch.Tensor) -> torch.Tensor:
            n = self.index.get(id(t))
            if n is None or t is not self.inputs[n]:
                self.misplaced.append((self._calls, _INPUT_NOT_INPUT + (
                    " Apply it directly to a tensor the model's forward receives (also "
                    "inside tuples, lists or dicts), before any other op uses it.")))
                return t
            self.marked[n] = self.marked.get(n, 0) + 1
            self.overlapping |= mode != OverlapMode.NoOverlap
            return _alias(t)
        return self._map(structure, mark)

    def mark_output(self, structure: Any, mode: OverlapMode) -> Any:
        self._calls += 1

        def mark(t: torch.Tensor) -> torch.Tensor:
            raw = self.root.get(id(t), t)
            alias = _alias(t)
            self.root[id(alias)] = raw
            self.outputs.append((self._calls, raw, alias))
            if mode != OverlapMode.NoOverlap:
                self.overlapping = True
            return alias
        return self._map(structure, mark)

    @staticmethod
    def _map(structure: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
        if isinstance(structure, torch.Tensor):
            return fn(structure)
        if isinstance(structure, dict):
            return type(structure)((k, _ForwardRecord._map(v, fn))
                                   for k, v in structure.items())
        items = [_ForwardRecord._map(v, fn) for v in structure]
        if isinstance(structure, tuple) and hasattr(structure, "_fields"):
            return type(structure)(*items)  # a namedtuple
        return type(structure)(items)

    # ------------------------------------------------------------------ the rules
    def check(self, output: Any, settings: OverlapSettings) -> None:
        """Raise ``poptorch.Error`` for the first rule ``output`` and the recorded
        markers break, in PopTorch's order (module docstring)."""
        leaves = [t for t in pytree.tree_leaves(output) if isinstance(t, torch.Tensor)]
        for n in sorted(self.marked):
            raw = self.inputs[n]
            others = list(self.uses.get(n, []))
            others += ["a second set_overlap_for_input"] * (self.marked[n] - 1)
            others += ["the model's return"] * sum(t is raw for t in leaves)
            if others:
                raise Error(_ONLY_OP.format(n=n) + (
                    f" Input {n} ({self.names[n]}) is also used by "
                    f"{', '.join(sorted(set(others)))}: apply set_overlap_for_input first "
                    "and use only the tensor it returns."))
        reached = set()
        for leaf in leaves:
            root = self.root.get(id(leaf))
            if root is None or id(leaf) in reached:
                continue
            count = sum(t is root or self.root.get(id(t)) is root for t in leaves)
            if count > 1:
                raise Error(_RETURNED_TWICE + " Return the marked tensor once only.")
            reached.add(id(leaf))
        for order, _, alias in self.outputs:
            if id(alias) not in reached:
                self.misplaced.append((order, _OUTPUT_NOT_OUTPUT + (
                    " Apply it to a tensor the model returns and return the tensor it "
                    "returns.")))
        if self.misplaced:
            raise Error(min(self.misplaced, key=lambda m: m[0])[1])
        if self.overlapping:
            if settings.pipelined:
                raise Error(_PIPELINED)
            if settings.io_tiles == 0:
                raise Error(_NO_IO_TILES)
            if settings.output_mode not in (OutputMode.All, OutputMode.Sum):
                raise Error(_OUTPUT_MODE)


def _input_tensors(forward: Callable[..., Any], args: tuple,
                   kwargs: dict) -> tuple[list[torch.Tensor], list[str]]:
    """The tensors ``forward`` receives, in its parameters' order, and their names."""
    try:
        bound = inspect.signature(forward).bind(*args, **kwargs)
        named = list(bound.arguments.items())
    except (TypeError, ValueError):
        named = [(f"argument {i}", a) for i, a in enumerate(args)] + list(kwargs.items())
    tensors, names = [], []
    for name, value in named:
        flat, _ = pytree.tree_flatten(value)
        inner = [t for t in flat if isinstance(t, torch.Tensor)]
        for i, t in enumerate(inner):
            tensors.append(t)
            names.append(f"'{name}'" if len(inner) == 1 and isinstance(value, torch.Tensor)
                         else f"tensor {i} of '{name}'")
    return tensors, names


class OverlapCheck:
    """Checks the overlap markers of the first forward run while this object is entered
    (``with``): the executor enters it around the compiling call (module docstring)."""

    def __init__(self, model: torch.nn.Module, settings: OverlapSettings) -> None:
        self.model = model
        self.settings = settings
        self._lock = threading.Lock()
        self._claimed = False
        self._saved: Any = None

    def __enter__(self) -> "OverlapCheck":
        model = self.model
        self._saved = model.__dict__.get("forward")
        original = model.forward

        def forward(*args: Any, **kwargs: Any) -> Any:
            with self._lock:
                claimed, self._claimed = self._claimed, True
            if claimed:  # only the first forward of the call is checked
                return original(*args, **kwargs)
            record = _ForwardRecord(*_input_tensors(original, args, kwargs))
            previous = context.set_overlap_checker(record)
            try:
                with record:
                    output = original(*args, **kwargs)
            finally:
                context.set_overlap_checker(previous)
            record.check(output, self.settings)
            return output

        forward.__wrapped__ = original  # type: ignore[attr-defined]  # (a function attribute: inspect.signature sees forward's parameters)
        if "torch._dynamo" in sys.modules:  # (not imported by eager-only programs)
            # a torch.compile'd forward runs this check eagerly (graph break)
            forward = dynamo().disable(forward)
        model.__dict__["forward"] = forward
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._saved is None:
            self.model.__dict__.pop("forward", None)
        else:
            self.model.__dict__["forward"] = self._saved

    @property
    def done(self) -> bool:
        """Whether a forward ran (and was checked) while this object was entered."""
        return self._claimed
