"""PopTorch's placement rules for ``set_overlap_for_input`` / ``set_overlap_for_output``.

The overlap itself has no meaning on CPUs and GPUs (the markers only record their hint),
but PopTorch refuses misplaced markers when it compiles a model, and so do we, once per
compiled model, before any weight changes:

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

The rules read a :class:`MarkerRecord` of what one forward pass did with its inputs and
the markers, made one of two ways:

* a model captured as a graph (model parallelism): the markers become nodes while the
  graph is traced, and ``placement/io_markers.py`` reads the record off the graph (the
  users of the placeholders, what the output node returns), before anything runs;
* any other model: its runner runs the first forward through a
  :class:`FirstForwardCheck`, under a :class:`~torch.overrides.TorchFunctionMode` that
  records which ops consume the raw input tensors, while the markers (through
  ``context.overlap_checker()``) return an alias (``view_as``: same storage, same
  values, autograd intact) of what they mark so that uses of the marked tensor can be
  told from uses of the raw one. The rules are checked when that forward returns; later
  forwards run the plain markers, which return their arguments: no cost after it.
"""
from __future__ import annotations

import inspect
from collections.abc import Callable, Collection, Hashable, Sequence
from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode, resolve_name

from ..._typing import UserOutput
from ...enums import OutputMode, OverlapMode
from ...errors import Error
from .. import context
from ..torch_internals import DisableTorchFunction, pytree

__all__ = ["FirstForwardCheck", "MarkerRecord", "OverlapSettings"]

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

#: Tensor attributes and methods that read metadata only: not ops on the tensor's values
#: (PopTorch traces no op for them), so they do not count as uses of a raw input.
METADATA_ATTRIBUTES = ("shape", "dtype", "device", "requires_grad", "ndim", "layout",
                       "is_cuda", "is_sparse", "is_quantized", "is_meta", "grad_fn",
                       "is_leaf", "names", "grad")
METADATA_METHODS = ("size", "dim", "ndimension", "numel", "nelement", "is_floating_point",
                    "is_complex", "stride", "storage_offset", "is_contiguous",
                    "element_size", "get_device", "data_ptr", "__len__", "__repr__",
                    "__format__", "__hash__")


def _metadata_functions() -> frozenset:
    """The torch functions a :class:`~torch.overrides.TorchFunctionMode` sees for the
    metadata reads."""
    found = [getattr(torch.Tensor, p).__get__ for p in METADATA_ATTRIBUTES
             if hasattr(torch.Tensor, p)]
    found += [getattr(torch.Tensor, m) for m in METADATA_METHODS if hasattr(torch.Tensor, m)]
    return frozenset(found)


_METADATA = _metadata_functions()


@dataclass(frozen=True)
class OverlapSettings:
    """The options rule 5 reads (module docstring)."""
    pipelined: bool
    io_tiles: int
    output_mode: OutputMode


@dataclass
class MarkerRecord:
    """What one forward pass did with its inputs and the markers. Values are named by
    keys (ids of live tensors in an eager forward, graph nodes in a captured one);
    ``input_keys[n]`` is input ``n``'s, counted over the tensors of ``forward``'s
    parameters in order (also inside tuples, lists and dicts)."""
    names: list[str]  # of the inputs, for messages
    input_keys: list[Hashable]
    uses: dict[int, list[str]] = field(default_factory=dict)  # input -> ops using it raw
    marked: dict[int, int] = field(default_factory=dict)  # input -> times marked
    misplaced: list[tuple[int, str]] = field(default_factory=list)  # (call order, message)
    outputs: list[tuple[int, Hashable]] = field(default_factory=list)  # (order, marked)
    root: dict[Hashable, Hashable] = field(default_factory=dict)  # marked output -> raw
    overlapping: bool = False
    calls: int = 0

    def next_call(self) -> int:
        """The order of a marker call (its errors come in call order)."""
        self.calls += 1
        return self.calls

    def use(self, n: int, op: str) -> None:
        self.uses.setdefault(n, []).append(op)

    def input_marked(self, n: int, mode: OverlapMode) -> None:
        self.marked[n] = self.marked.get(n, 0) + 1
        self.overlapping |= mode != OverlapMode.NoOverlap

    def input_misplaced(self, order: int) -> None:
        self.misplaced.append((order, _INPUT_NOT_INPUT + (
            " Apply it directly to a tensor the model's forward receives (also inside "
            "tuples, lists or dicts), before any other op uses it.")))

    def output_marked(self, order: int, raw: Hashable, marked: Hashable,
                      mode: OverlapMode) -> None:
        self.root[marked] = self.root.get(raw, raw)
        self.outputs.append((order, marked))
        self.overlapping |= mode != OverlapMode.NoOverlap

    def check(self, returned: Sequence[Hashable], settings: OverlapSettings) -> None:
        """Raise ``poptorch.Error`` for the first rule broken, in PopTorch's order
        (module docstring); ``returned``: the keys of the tensors the model returned,
        in order."""
        for n in sorted(self.marked):
            raw = self.input_keys[n]
            others = list(self.uses.get(n, []))
            others += ["a second set_overlap_for_input"] * (self.marked[n] - 1)
            others += ["the model's return"] * sum(k == raw for k in returned)
            if others:
                raise Error(_ONLY_OP.format(n=n) + (
                    f" Input {n} ({self.names[n]}) is also used by "
                    f"{', '.join(sorted(set(others)))}: apply set_overlap_for_input first "
                    "and use only the tensor it returns."))
        reached = set()
        for leaf in returned:
            root = self.root.get(leaf)
            if root is None or leaf in reached:
                continue
            count = sum(k == root or self.root.get(k) == root for k in returned)
            if count > 1:
                raise Error(_RETURNED_TWICE + " Return the marked tensor once only.")
            reached.add(leaf)
        misplaced = list(self.misplaced)
        for order, marked in self.outputs:
            if marked not in reached:
                misplaced.append((order, _OUTPUT_NOT_OUTPUT + (
                    " Apply it to a tensor the model returns and return the tensor it "
                    "returns.")))
        if misplaced:
            raise Error(min(misplaced, key=lambda m: m[0])[1])
        if self.overlapping:
            if settings.pipelined:
                raise Error(_PIPELINED)
            if settings.io_tiles == 0:
                raise Error(_NO_IO_TILES)
            if settings.output_mode not in (OutputMode.All, OutputMode.Sum):
                raise Error(_OUTPUT_MODE)


def _alias(tensor: torch.Tensor) -> torch.Tensor:
    """A new tensor object viewing ``tensor`` (same storage and values, differentiable),
    made outside every torch function mode so that no mode sees the marker as an op."""
    with DisableTorchFunction():
        return tensor.view_as(tensor)


def map_structure(structure: UserOutput, fn: Callable[[UserOutput], UserOutput]
                  ) -> UserOutput:
    """``structure`` (a leaf, or tuples / lists / dicts / namedtuples of them) with
    ``fn`` applied to every leaf."""
    if isinstance(structure, dict):
        return type(structure)((k, map_structure(v, fn)) for k, v in structure.items())
    if isinstance(structure, (list, tuple)):
        items = [map_structure(v, fn) for v in structure]
        if isinstance(structure, tuple) and hasattr(structure, "_fields"):
            return type(structure)(*items)  # a namedtuple
        return type(structure)(items)
    return fn(structure)


class _ForwardRecord(TorchFunctionMode):
    """Records one eager forward into a :class:`MarkerRecord` (module docstring)."""

    def __init__(self, inputs: list[torch.Tensor], names: list[str]) -> None:
        super().__init__()
        self.inputs = inputs  # kept alive: their ids stay theirs during the forward
        self.index: dict[int, int] = {}
        for n, t in enumerate(inputs):
            self.index.setdefault(id(t), n)
        self.record = MarkerRecord(names, [id(t) for t in inputs])
        self._kept: list[torch.Tensor] = []  # marked outputs and their aliases, alive

    def __torch_function__(self, func: Callable[..., object], types: Collection[type],
                           args: tuple[object, ...] = (),
                           kwargs: dict[str, object] | None = None) -> object:
        kwargs = kwargs or {}
        if func not in _METADATA:
            for leaf in pytree.tree_leaves((args, kwargs)):
                if isinstance(leaf, torch.Tensor):
                    n = self.index.get(id(leaf))
                    if n is not None and leaf is self.inputs[n]:
                        self.record.use(n, resolve_name(func) or
                                        getattr(func, "__name__", "?"))
        return func(*args, **kwargs)

    # the markers (ops/hints.py) call these while this forward runs
    def mark_input(self, structure: UserOutput, mode: OverlapMode) -> UserOutput:
        order = self.record.next_call()

        def mark(t: torch.Tensor) -> torch.Tensor:
            n = self.index.get(id(t))
            if n is None or t is not self.inputs[n]:
                self.record.input_misplaced(order)
                return t
            self.record.input_marked(n, mode)
            return _alias(t)
        return map_structure(structure, mark)

    def mark_output(self, structure: UserOutput, mode: OverlapMode) -> UserOutput:
        order = self.record.next_call()

        def mark(t: torch.Tensor) -> torch.Tensor:
            alias = _alias(t)
            self._kept += [t, alias]
            self.record.output_marked(order, id(t), id(alias), mode)
            return alias
        return map_structure(structure, mark)


def input_tensors(forward: Callable[..., UserOutput], args: tuple,
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


class FirstForwardCheck:
    """Checks the overlap markers of the first forward a runner runs through
    :meth:`run` (module docstring); ``done`` once one passed. A runner whose model was
    not captured calls ``run`` instead of the forward on its first micro-batch."""

    def __init__(self, settings: OverlapSettings) -> None:
        self.settings = settings
        self.done = False

    def run(self, forward: Callable[..., UserOutput], args: tuple, kwargs: dict
            ) -> UserOutput:
        """``forward(*args, **kwargs)``, checked the first time (``poptorch.Error`` when
        a rule is broken: the next call checks again). A ``torch.compile``'d forward
        runs eagerly for the check (the markers are Python)."""
        if self.done:
            return forward(*args, **kwargs)
        mode = _ForwardRecord(*input_tensors(forward, args, kwargs))
        previous = context.set_overlap_checker(mode)
        try:
            with torch.compiler.set_stance("force_eager"), mode:
                output = forward(*args, **kwargs)
        finally:
            context.set_overlap_checker(previous)
        returned = [id(t) for t in pytree.tree_leaves(output) if isinstance(t, torch.Tensor)]
        mode.record.check(returned, self.settings)
        self.done = True
        return output
