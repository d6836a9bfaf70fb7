"""Graph capture of an annotated model: its forward pass as a graph whose nodes carry
the block they belong to (``BLOCK_META``), split into stages by ``stages.py``.

:func:`capture` tries ``torch.export`` first (``export_capture.py``: the model runs
once on fake tensors of the call's shapes, so ordinary shape code captures; the graph
is checked against every later call's shapes), then ``torch.fx`` symbolic tracing
(this module: proxies, any shape). A model with forward or backward hooks of its own
is traced with fx first: an exported graph would run its hooks at capture only.

The block annotations that only show while the model runs report to a listener that
tags every node made afterwards with the current block (as ``pipe_split`` marks split
points); for fx, a ``BeginBlock`` on a leaf module (one ``call_module`` node, whose
hooks do not run) is reported by the tracer itself. The same pass yields the
:class:`~.partition.BlockTrace` the partition rules need, without running a kernel.
The overlap markers become nodes, checked and removed by :mod:`.io_markers`.

A ``torch.autograd.Function`` whose backward reaches the outputs is kept by neither
tracer (both record its forward only). When no tracer captures the model,
:class:`CaptureUnsupported` says what stopped each and the runtime runs the stages one
after another (``sequential.py``).
"""
from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.fx
from torch.fx.node import Argument, Target

from .. import context
from ..program.overlapped_io import OverlapSettings
from ..torch_internals import call_hooks, forward_pre_hooks
from . import io_markers, markers, recompute
from .captured import (
    BLOCK_META,
    CapturedModel,
    CaptureUnsupported,
    CustomBackward,
    bind_arguments,
    record_weight_users,
    tracing,
)
from .export_capture import export_model
from .partition import BlockRecorder
from .strategy import ExecutionStrategy

__all__ = ["CaptureUnsupported", "CapturedModel", "capture", "check_markers", "trace_model"]

#: what to change, said when neither tracer captures a model
_ADVICE = ("to pipeline it, make its forward traceable by torch.export: no Python "
           "branch or loop on tensor values (torch.where / torch.cond instead), no "
           ".item() / .tolist() / print of tensors, and tensor-only arguments (or "
           "plain Python values)")


class _BlockTracer(BlockRecorder, torch.fx.Tracer):
    """fx tracer + block recorder: tags nodes with the block they were made in."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(model)
        self._making_args = False
        # fx's guards of the non-tensor arguments baked into the graph (checked by
        # CapturedModel.inputs_of instead): removed once traced
        self.guards: list[torch.fx.Node] = []

    # block listener ------------------------------------------------------------------
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
    def create_args_for_root(self, root_fn: Callable[..., object], is_module: bool,
                             concrete_args: dict[str, object] | tuple[object, ...] | None
                             = None) -> tuple[Callable[..., object], list[object]]:
        self._making_args = True
        try:
            return super().create_args_for_root(root_fn, is_module, concrete_args)
        finally:
            self._making_args = False

    def call_module(self, m: torch.nn.Module, forward: Callable[..., object],
                    args: tuple[object, ...], kwargs: dict[str, object]) -> object:
        if self.is_leaf_module(m, self.path_of_module(m)):
            hook = markers.begin_block_of(m)
            if hook is not None:  # leaf: fx emits one node and runs no hook
                hook(m, args)
        return super().call_module(m, forward, args, kwargs)

    def create_node(self, kind: str, target: Target, args: tuple[Argument, ...],
                    kwargs: dict[str, Argument], name: str | None = None,
                    type_expr: object = None) -> torch.fx.Node:
        node = super().create_node(kind, target, args, kwargs, name, type_expr)
        if self._making_args:
            if kind != "placeholder":
                self.guards.append(node)
            return node
        # (overlap markers are no op of a block: removed once checked)
        if kind not in ("placeholder", "get_attr", "output") and not io_markers.is_marker(target):
            node.meta[BLOCK_META] = self.block_now()
        return node


def capture(model: torch.nn.Module, args: tuple, kwargs: dict, strategy: ExecutionStrategy,
            overlap: OverlapSettings | None = None, fx_first: bool = False) -> CapturedModel:
    """Capture ``model`` for arguments like ``(args, kwargs)`` (only whether each one is a
    tensor, and the non-tensor values, matter). Raises :class:`CaptureUnsupported`
    (why) when it cannot be captured, and ``poptorch.Error`` when its overlap markers
    break PopTorch's rules (checked with the options' ``overlap`` settings given)."""
    tracers = [("torch.export", export_model), ("torch.fx", trace_model)]
    # fx keeps the hooked calls as calls: hooks (and run-time rewrites of module calls,
    # ``fx_first``) apply on every call
    if fx_first or _has_call_hooks(model):
        tracers.reverse()
    failures = []
    for name, tracer in tracers:
        try:
            captured = tracer(model, args, kwargs, strategy)
        except CustomBackward as exc:  # (fx would drop that backward silently)
            raise CaptureUnsupported(f"graph capture failed: {exc}") from None
        except Exception as exc:  # pylint: disable=broad-except
            failures.append(f"{name}: {_why(exc)}")
            continue
        return check_markers(captured, overlap)
    raise CaptureUnsupported(f"graph capture failed: {'; '.join(failures)}; {_ADVICE}")


def _has_call_hooks(model: torch.nn.Module) -> bool:
    """Whether a module of ``model`` has a user's forward / backward hook (or forward
    pre-hook other than PopTorch's own, or ``Module.autocast()``'s casting): an exported
    graph would run it once, on fake tensors, where the fx graph calls the hooked leaf
    module on every call."""
    own = (recompute.start_forward_hook, recompute.end_forward_hook)
    for module in model.modules():
        if any(h not in own for h in call_hooks(module)):
            return True
        # ``Module.autocast()``: its casting hooks are installed on the module after
        # the capture, and run only where the graph calls the module
        if getattr(module, "_poptorch_autocast", None):
            return True
        if any(h not in own and not isinstance(h, markers.BeginBlockHook)
               for h in forward_pre_hooks(module).values()):
            return True
    return False


def _why(exc: BaseException) -> str:
    """The first line of ``exc``'s message, with its class (the INFO line's reason)."""
    text = str(exc).strip().splitlines()
    first = text[0] if text else ""
    if len(first) > 300:
        first = first[:300] + "..."
    return f"{type(exc).__name__}: {first}" if not isinstance(
        exc, CaptureUnsupported) else first


def check_markers(captured: CapturedModel, overlap: OverlapSettings | None) -> CapturedModel:
    """``captured`` with its overlap markers checked (``overlap``: the options' settings;
    None: not checked) and removed from its graph."""
    if captured.markers is not None:
        io_markers.finish(captured.graph_module, captured.markers, overlap)
        captured.markers = None
    return captured


def trace_model(model: torch.nn.Module, args: tuple, kwargs: dict,
                strategy: ExecutionStrategy) -> CapturedModel:
    """The traced model, its overlap markers still nodes of the graph (for
    ``io_markers.finish``); raises whatever stopped the trace."""
    signature = inspect.signature(model.forward)
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in signature.parameters.values()):
        raise CaptureUnsupported("forward takes *args or **kwargs")
    bound, concrete = bind_arguments(signature, args, kwargs)
    tracer = _BlockTracer(model)
    overlap = io_markers.GraphMarkers(tracer, dict(bound.arguments), model.forward, args,
                                      kwargs)
    losses_before = len(context.marked_losses())
    try:
        with tracing(tracer, overlap, strategy):
            graph = tracer.trace(model, concrete_args=dict(concrete) or None)
    finally:
        marked = context.marked_losses()
        loss_proxies = marked[losses_before:]
        del marked[losses_before:]
    loss_nodes = [p.node for p in loss_proxies if isinstance(p, torch.fx.Proxy)]
    if len(loss_nodes) != len(loss_proxies):
        raise CaptureUnsupported("a loss was marked with a value that is not traced")
    _drop_baked_arguments(graph, tracer.guards, set(bound.arguments) - set(concrete))
    gm = torch.fx.GraphModule(model, graph, class_name=type(model).__name__ + "Captured")
    trace = tracer.block_trace
    record_weight_users(gm, trace)
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
