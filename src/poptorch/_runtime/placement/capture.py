"""Graph capture of an annotated model: the model's forward pass as a ``torch.fx`` graph
whose nodes carry the block they belong to.

``torch.fx`` symbolic tracing runs ``forward`` once with proxies, so the block
annotations that only show while the model runs (``poptorch.Block``,
``BlockFunction``, ``IPU`` as a context manager, ``BeginBlock`` hooks on non-leaf
modules) report to a listener that tags every node created afterwards with the current
block, the way ``torch.distributed.pipelining.pipe_split`` marks split points. A
``BeginBlock`` on a leaf module (``torch.nn.Linear``: traced as one ``call_module``
node, its hooks do not run) is reported by the tracer itself.

The same pass yields the :class:`~.partition.BlockTrace` the partition rules need (the
blocks in order, their IPUs, which block uses which weight) without running a single
kernel. The overlap markers (``set_overlap_for_input`` / ``set_overlap_for_output``)
become nodes too, checked against PopTorch's rules on the graph and then removed
(:mod:`.io_markers`). Capture is impossible for some models (data-dependent control
flow, ``*args`` signatures, non-tensor arguments holding tensors): :func:`capture` then
raises :class:`CaptureUnsupported` saying why, and the runtime runs the model's stages
one after another (``sequential.py``).
"""
from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
from torch.fx.node import Argument, Target

from .. import context
from ..program.overlapped_io import OverlapSettings
from ..torch_internals import pytree
from . import io_markers, markers, recompute
from .partition import IMPLICIT_BLOCK, BlockTrace, _Tracer

BLOCK_META = "poptorch_block"


class CaptureUnsupported(Exception):
    """The model cannot be captured (the message says why)."""


@dataclass
class CapturedModel:
    """A model's forward pass as a block-tagged graph."""
    graph_module: torch.fx.GraphModule
    trace: BlockTrace
    signature: inspect.Signature
    placeholders: list[str]  # forward parameter name of each placeholder, in order
    concrete: dict[str, Any]  # non-tensor arguments baked into the graph
    loss_nodes: list[torch.fx.Node] = field(default_factory=list)  # identity_loss marks
    checkpoints: int = 0  # recomputation checkpoints in the graph
    # the overlap markers, nodes of the graph until io_markers.finish removes them
    markers: io_markers.GraphMarkers | None = None

    def inputs_of(self, args: tuple, kwargs: dict) -> dict[str, Any] | None:
        """The placeholder values of one micro-batch, or None when the micro-batch's
        non-tensor arguments differ from those the graph was captured with."""
        bound = self.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        values = bound.arguments
        for name, value in self.concrete.items():
            if not _same_constant(values.get(name), value):
                return None
        return {name: values[name] for name in self.placeholders}


class _BlockTracer(torch.fx.Tracer):
    """fx tracer + block listener: tags nodes with the block they were made in."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.blocks = _Tracer(model)  # the block bookkeeping (sequence, IPUs, rules)
        self.checkpoints = 0
        self._making_args = False
        # fx's guards of the non-tensor arguments baked into the graph (checked by
        # CapturedModel.inputs_of instead): removed once traced
        self.guards: list[torch.fx.Node] = []

    # block listener ------------------------------------------------------------------
    def reset_auto_id(self) -> None:
        self.blocks.reset_auto_id()

    def begin_block(self, user_id: str | int | None, ipu_id: int | None,
                    layer: torch.nn.Module | None = None) -> None:
        self.blocks.begin_block(user_id, ipu_id, layer=layer)

    def checkpoint(self, tensors: list) -> list:
        """A recomputation checkpoint becomes a node (``recompute.checkpoint_values``)
        that cuts its stage's recording into segments when the stage runs."""
        if not all(isinstance(t, torch.fx.Proxy) for t in tensors):
            raise CaptureUnsupported("a recomputation checkpoint of untraced values")
        self.checkpoints += 1
        # (Any: fx gives Proxy its operators, indexing included, at run time)
        node: Any = self.create_proxy("call_function", recompute.checkpoint_values,
                                      tuple(tensors), {})
        return [node[i] for i in range(len(tensors))]

    # fx tracer -----------------------------------------------------------------------
    def create_args_for_root(self, root_fn: Callable[..., Any], is_module: bool,
                             concrete_args: dict[str, Any] | tuple[Any, ...] | None = None
                             ) -> tuple[Any, list[Any]]:
        self._making_args = True
        try:
            return super().create_args_for_root(root_fn, is_module, concrete_args)
        finally:
            self._making_args = False

    def call_module(self, m: torch.nn.Module, forward: Callable[..., Any],
                    args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self.is_leaf_module(m, self.path_of_module(m)):
            hook = markers.begin_block_of(m)
            if hook is not None:  # leaf: fx emits one node and runs no hook
                hook(m, args)
        return super().call_module(m, forward, args, kwargs)

    def create_node(self, kind: str, target: Target, args: tuple[Argument, ...],
                    kwargs: dict[str, Argument], name: str | None = None,
                    type_expr: Any | None = None) -> torch.fx.Node:
        node = super().create_node(kind, target, args, kwargs, name, type_expr)
        if self._making_args:
            if kind != "placeholder":
                self.guards.append(node)
            return node
        # (overlap markers are no op of a block: removed once checked)
        if kind not in ("placeholder", "get_attr", "output") and not io_markers.is_marker(target):
            if self.blocks.current is None:
                self.blocks._enter_implicit()
            node.meta[BLOCK_META] = self.blocks.current
        return node


def capture(model: torch.nn.Module, args: tuple, kwargs: dict, strategy: Any,
            overlap: OverlapSettings | None = None) -> CapturedModel:
    """Capture ``model`` for arguments like ``(args, kwargs)`` (only whether each one is a
    tensor, and the non-tensor values, matter). Raises :class:`CaptureUnsupported`
    (why) when it cannot be captured, and ``poptorch.Error`` when its overlap markers
    break PopTorch's rules (checked with the options' ``overlap`` settings given)."""
    try:
        captured = trace_model(model, args, kwargs, strategy)
    except Exception as exc:  # pylint: disable=broad-except
        raise CaptureUnsupported(f"graph capture failed: {type(exc).__name__}: "
                                 f"{exc}") from None
    return check_markers(captured, overlap)


def check_markers(captured: CapturedModel, overlap: OverlapSettings | None) -> CapturedModel:
    """``captured`` with its overlap markers checked (``overlap``: the options' settings;
    None: not checked) and removed from its graph."""
    if captured.markers is not None:
        io_markers.finish(captured.graph_module, captured.markers, overlap)
        captured.markers = None
    return captured


def trace_model(model: torch.nn.Module, args: tuple, kwargs: dict,
                strategy: Any) -> CapturedModel:
    """The traced model, its overlap markers still nodes of the graph (for
    ``io_markers.finish``); raises whatever stopped the trace."""
    signature = inspect.signature(model.forward)
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in signature.parameters.values()):
        raise CaptureUnsupported("forward takes *args or **kwargs")
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    concrete = {name: value for name, value in bound.arguments.items()
                if not _is_traced_input(value)}
    for name, value in concrete.items():
        if any(isinstance(v, torch.Tensor) for v in pytree.tree_leaves(value)):
            raise CaptureUnsupported(f"argument {name!r} holds tensors and other values")
    tracer = _BlockTracer(model)
    overlap = io_markers.GraphMarkers(tracer, dict(bound.arguments), model.forward, args,
                                      kwargs)
    strategy.onStartTracing()
    previous = markers.set_listener(tracer)
    previous_checker = context.set_overlap_checker(overlap)
    losses_before = len(context.marked_losses())
    try:
        with context.running_on_ipu(), recompute.recording(None):
            graph = tracer.trace(model, concrete_args=dict(concrete) or None)
    finally:
        markers.set_listener(previous)
        context.set_overlap_checker(previous_checker)
        strategy.onEndTracing()
        marked = context.marked_losses()
        loss_proxies = marked[losses_before:]
        del marked[losses_before:]
    loss_nodes = [p.node for p in loss_proxies if isinstance(p, torch.fx.Proxy)]
    if len(loss_nodes) != len(loss_proxies):
        raise CaptureUnsupported("a loss was marked with a value that is not traced")
    _drop_baked_arguments(graph, tracer.guards, set(bound.arguments) - set(concrete))
    gm = torch.fx.GraphModule(model, graph, class_name=type(model).__name__ + "Captured")
    trace = tracer.blocks.trace
    _record_weight_users(gm, trace, model)
    placeholders = [n.target for n in gm.graph.nodes if n.op == "placeholder"
                    and n.target in bound.arguments and n.target not in concrete]
    return CapturedModel(gm, trace, signature, placeholders, concrete, loss_nodes,
                         tracer.checkpoints, overlap)


def _drop_baked_arguments(graph: torch.fx.Graph, guards: list[torch.fx.Node],
                          traced: set[str]) -> None:
    """Remove fx's guards of the arguments baked into the graph and their placeholders
    (the value of each is a constant of the graph)."""
    for node in reversed(guards):
        if node.users:
            raise CaptureUnsupported("a guard of a non-tensor argument is used")
        graph.erase_node(node)
    for node in list(graph.nodes):
        if node.op == "placeholder" and node.target not in traced:
            if node.users:
                raise CaptureUnsupported(f"the non-tensor argument {node.target!r} is used")
            graph.erase_node(node)


def _is_traced_input(value: Any) -> bool:
    """Tensors (and containers of tensors) become graph inputs; the rest is baked in."""
    leaves = pytree.tree_leaves(value)
    return bool(leaves) and all(isinstance(v, torch.Tensor) for v in leaves)


def _same_constant(a: Any, b: Any) -> bool:
    try:
        return a is b or bool(a == b)
    except Exception:  # pylint: disable=broad-except
        return False


def _record_weight_users(gm: torch.fx.GraphModule, trace: BlockTrace,
                         model: torch.nn.Module) -> None:
    """Which block uses which parameter / buffer (as ``partition.trace_blocks`` records them)."""
    users = trace.users
    for node in gm.graph.nodes:
        block = node.meta.get(BLOCK_META)
        if block is None:
            continue
        tensors: list[torch.Tensor] = []
        if node.op == "call_module":
            sub = gm.get_submodule(node.target)
            tensors += list(sub.parameters()) + list(sub.buffers())
        for arg in node.all_input_nodes:
            if arg.op == "get_attr":
                value = _fetch_attr(gm, arg.target)
                if isinstance(value, torch.Tensor):
                    tensors.append(value)
        for t in tensors:
            if id(t) in trace.tensor_names:
                blocks = users.setdefault(id(t), [])
                if block not in blocks:
                    blocks.append(block)
    if not trace.sequence:  # a forward with no operation at all
        trace.sequence.append(IMPLICIT_BLOCK)
        trace.ipu_of[IMPLICIT_BLOCK] = 0


def _fetch_attr(gm: torch.nn.Module, target: str) -> Any:
    value: Any = gm
    for part in target.split("."):
        value = getattr(value, part)
    return value
