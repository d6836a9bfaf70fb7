"""The overlap markers of a captured model: nodes of its graph, checked on the graph.

While a model is captured, ``set_overlap_for_input`` / ``set_overlap_for_output``
(``ops/hints.py``) report to a :class:`GraphMarkers` (``context.overlap_checker()``),
which adds one marker node per marked value (:class:`ExportMarkers`, under
``torch.export``, records ``capture_ops.overlap_marker`` calls and turns them into the
same nodes). :meth:`GraphMarkers.record` then reads PopTorch's
:class:`~..program.overlapped_io.MarkerRecord` off the graph:

* the placeholders, and the ``getitem`` nodes picking values out of a container
  placeholder, are the raw inputs (the example call says which tensors they hold);
* every other node reading a raw input uses it (metadata reads such as ``x.shape``
  excepted), and so does the model's return when it returns one;
* the leaves of the output node are what the model returns.

:func:`finish` checks the rules and removes the marker nodes: stages never run them.
"""
from __future__ import annotations

import operator
from collections.abc import Callable, Hashable
from typing import TypeVar, cast

import torch
import torch.fx

from ..._typing import UserInput, UserOutput
from ...enums import OverlapMode
from ..program.overlapped_io import (
    METADATA_ATTRIBUTES,
    METADATA_METHODS,
    MarkerRecord,
    OverlapSettings,
    input_tensors,
    map_structure,
)
from ..torch_internals import pytree
from . import capture_ops

_MARKER_META = "poptorch_overlap_marker"  # (kind, call order, mode) of a marker node

_T = TypeVar("_T")

#: a marked leaf: a traced tensor (an fx proxy while traced, a tensor while exported)
_Leaf = torch.Tensor | torch.fx.Proxy


def input_marker(value: _T) -> _T:
    """The target of a ``set_overlap_for_input`` node (removed before anything runs)."""
    return value


def output_marker(value: _T) -> _T:
    """The target of a ``set_overlap_for_output`` node (removed before anything runs)."""
    return value


def is_marker(target: object) -> bool:
    """Whether ``target`` is that of a marker node."""
    return target is input_marker or target is output_marker


class GraphMarkers:
    """The overlap checker of a model being traced (module docstring). ``example``:
    the arguments of the traced call by parameter name; ``forward``, ``args`` and
    ``kwargs`` number the input tensors as an eager forward would."""

    def __init__(self, tracer: torch.fx.Tracer | None, example: dict[str, UserInput],
                 forward: Callable[..., UserOutput], args: tuple, kwargs: dict) -> None:
        self.tracer = tracer
        self.example = example
        self.tensors, self.names = input_tensors(forward, args, kwargs)
        self.calls = 0
        self.nodes: list[torch.fx.Node] = []
        self.untraced: list[int] = []  # call orders of input markers on untraced tensors

    # the markers (ops/hints.py) call these while the model is traced
    def mark_input(self, structure: UserInput, mode: OverlapMode) -> UserInput:
        return self._mark(structure, input_marker, "input", mode)

    def mark_output(self, structure: UserOutput, mode: OverlapMode) -> UserOutput:
        return self._mark(structure, output_marker, "output", mode)

    def _mark(self, structure: UserInput, target: Callable[..., object], kind: str,
              mode: OverlapMode) -> UserInput:
        self.calls += 1
        order = self.calls

        def mark(value: _Leaf) -> _Leaf:
            return self._emit(value, target, kind, order, mode)
        return map_structure(structure, mark)

    def _emit(self, value: _Leaf, target: Callable[..., object], kind: str, order: int,
              mode: OverlapMode) -> _Leaf:
        """The marked value: a marker node of the fx graph being traced."""
        if not isinstance(value, torch.fx.Proxy):  # a tensor no traced op made
            if kind == "input":  # ... is no input of the model
                self.untraced.append(order)
                return value
            raise ValueError("set_overlap_for_output of a tensor the graph does not "
                             "trace")
        assert self.tracer is not None  # (the fx capture gives its tracer)
        proxy = self.tracer.create_proxy("call_function", target, (value, ), {})
        proxy.node.meta[_MARKER_META] = (kind, order, mode)
        self.nodes.append(proxy.node)
        return proxy

    # after tracing
    def record(self, graph: torch.fx.Graph) -> tuple[MarkerRecord, list[Hashable]]:
        """The record of the traced forward, and the keys of what it returns."""
        index: dict[int, int] = {}
        for n, t in enumerate(self.tensors):
            index.setdefault(id(t), n)
        record = MarkerRecord(self.names, [("input", n) for n in range(len(self.tensors))])
        for order in self.untraced:
            record.input_misplaced(order)
        raw: dict[torch.fx.Node, list[int]] = {}  # raw input nodes -> input tensors held
        values: dict[torch.fx.Node, UserInput] = {}  # ... and their values in the example

        def hold(node: torch.fx.Node, value: UserInput) -> None:
            values[node] = value
            raw[node] = [index[id(t)] for t in pytree.tree_leaves(value)
                         if isinstance(t, torch.Tensor) and id(t) in index]

        def key(node: torch.fx.Node) -> Hashable:
            held = raw.get(node)
            if held and len(held) == 1 and isinstance(values[node], torch.Tensor):
                return record.input_keys[held[0]]
            return node

        returned: list[Hashable] = []
        for node in graph.nodes:
            if node.op == "placeholder":
                if node.target in self.example:
                    hold(node, self.example[node.target])
                continue
            if node.op == "output":
                for leaf in pytree.tree_leaves(node.args[0]):
                    if isinstance(leaf, torch.fx.Node):
                        held = raw.get(leaf)
                        returned += ([record.input_keys[n] for n in held] if held
                                     else [leaf])
                continue
            marker = node.meta.get(_MARKER_META)
            if marker is not None:
                kind, order, mode = marker
                arg = node.args[0]
                if kind == "output":
                    record.output_marked(order, key(arg) if isinstance(arg, torch.fx.Node)
                                         else arg, node, mode)
                elif isinstance(arg, torch.fx.Node) and raw.get(arg):
                    for n in raw[arg]:
                        record.input_marked(n, mode)
                else:
                    record.input_misplaced(order)
                continue
            picked = _picked(node, values)
            if picked is not _NOTHING:
                hold(node, picked)
                continue
            if _reads_metadata(node):
                continue
            for arg in node.all_input_nodes:
                for n in raw.get(arg, ()):
                    record.use(n, _op_name(node))
        return record, returned


class ExportMarkers(GraphMarkers):
    """The overlap checker of a model exported with ``torch.export``: every marker is
    a ``capture_ops.overlap_marker`` call (``torch.export`` records operators only),
    which :meth:`adopt` replaces with the marker node the fx capture makes."""

    def __init__(self, example: dict[str, UserInput], forward: Callable[..., UserOutput],
                 args: tuple, kwargs: dict) -> None:
        super().__init__(None, example, forward, args, kwargs)
        self._pending: dict[int, tuple[Callable[..., object], str, OverlapMode]] = {}

    def _emit(self, value: _Leaf, target: Callable[..., object], kind: str, order: int,
              mode: OverlapMode) -> _Leaf:
        self._pending[order] = (target, kind, mode)
        # (an exported forward's values are tensors, never fx proxies)
        return capture_ops.overlap_marker(cast(torch.Tensor, value), order)

    def adopt(self, graph: torch.fx.Graph, order: int, marked: torch.fx.Node
              ) -> torch.fx.Node:
        """The marker node (in ``graph``, on ``marked``) of the ``order``-th marker."""
        target, kind, mode = self._pending[order]
        node = graph.call_function(target, (marked, ))
        node.meta[_MARKER_META] = (kind, order, mode)
        self.nodes.append(node)
        return node


_NOTHING = object()


def _picked(node: torch.fx.Node, values: dict[torch.fx.Node, UserInput]) -> UserInput:
    """The value a ``getitem`` node picks out of a tuple, list or dict input (indexing
    a container is no op on a tensor); ``_NOTHING`` for any other node."""
    if node.op != "call_function" or node.target is not operator.getitem:
        return _NOTHING
    source, item = node.args
    if not isinstance(source, torch.fx.Node) or source not in values \
            or not isinstance(values[source], (tuple, list, dict)) \
            or isinstance(item, torch.fx.Node):
        return _NOTHING
    try:
        return values[source][item]
    except (IndexError, KeyError, TypeError):
        return _NOTHING


#: the ATen operators of an exported graph that read a tensor's metadata only
_METADATA_OPS = (torch.ops.aten.sym_size.int, torch.ops.aten.sym_size.default,
                 torch.ops.aten.sym_numel.default, torch.ops.aten.sym_stride.int,
                 torch.ops.aten.sym_storage_offset.default)


def _reads_metadata(node: torch.fx.Node) -> bool:
    if node.op == "call_function" and node.target in _METADATA_OPS:
        return True
    if node.op == "call_method":
        return node.target in METADATA_METHODS
    return (node.op == "call_function" and node.target is getattr
            and len(node.args) > 1 and node.args[1] in METADATA_ATTRIBUTES)


def _op_name(node: torch.fx.Node) -> str:
    if node.op == "call_module":
        module = node.graph.owning_module
        if module is not None:
            return type(module.get_submodule(str(node.target))).__name__
    if isinstance(node.target, str):
        return node.target
    packet = getattr(node.target, "overloadpacket", None)  # an ATen op (exported)
    if packet is not None:
        return str(getattr(packet, "__name__", packet))
    return getattr(node.target, "__name__", str(node.target))


def finish(gm: torch.fx.GraphModule, markers: GraphMarkers,
           settings: OverlapSettings | None) -> None:
    """Check the markers against PopTorch's rules (``settings``: the options they read;
    None: not checked), then remove them from ``gm``."""
    if settings is not None and (markers.nodes or markers.untraced):
        record, returned = markers.record(gm.graph)
        record.check(returned, settings)
    for node in reversed(markers.nodes):
        marked = node.args[0]
        assert isinstance(marked, torch.fx.Node)  # (tensors are traced as nodes)
        node.replace_all_uses_with(marked)
        gm.graph.erase_node(node)
    if markers.nodes:
        gm.recompile()
