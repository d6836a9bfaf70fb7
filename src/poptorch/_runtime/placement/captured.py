"""What a capture yields: the block-tagged graph of a model's forward pass
(:class:`CapturedModel`), and the checks a later call's arguments pass before the graph
runs them (the non-tensor values it was captured with; for an exported graph, the
shapes and dtypes of its tensors: :class:`ShapeGuard`). Shared by both captures
(``capture.py``, ``export_capture.py``).
"""
from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from dataclasses import dataclass, field
from operator import attrgetter

import sympy
import torch
import torch.fx

from ..._typing import UserInput
from .. import context
from ..torch_internals import pytree
from . import io_markers, markers, recompute
from .partition import BlockTrace
from .strategy import ExecutionStrategy

BLOCK_META = "poptorch_block"
# export traces a symbolic size as neither 0 nor 1 (a branch on ``size > 1`` is
# taken): a graph's symbolic sizes hold from 2 up, whatever range it states
_TRACED_FROM = 2


class CaptureUnsupported(Exception):
    """The model cannot be captured (the message says why)."""


class CustomBackward(CaptureUnsupported):
    """The forward calls a ``torch.autograd.Function`` whose backward reaches the
    model's outputs: no captured graph keeps that backward (export and fx symbolic
    tracing both record its forward only), so the model is not captured at all."""


@dataclass
class ShapeGuard:
    """The tensors an exported graph was captured for: per tensor leaf of the traced
    arguments (in pytree order), its dtype and its sizes, each an int or a sympy
    expression of the symbolic sizes (dimension 0 is symbolic where export kept it
    so), with the range each symbol may take."""
    dtypes: list[torch.dtype]
    sizes: list[tuple[int | sympy.Expr, ...]]
    ranges: dict[sympy.Symbol, tuple[int, int | None]]

    def accepts(self, leaves: list[object]) -> bool:
        """Whether tensors ``leaves`` are like the captured ones (same count, dtypes,
        ranks and sizes, symbolic sizes bound consistently and within range)."""
        if len(leaves) != len(self.sizes):
            return False
        bound: dict[sympy.Symbol, int] = {}
        later: list[tuple[sympy.Expr, int]] = []
        for t, dtype, sizes in zip(leaves, self.dtypes, self.sizes, strict=True):
            if not isinstance(t, torch.Tensor) or t.dtype != dtype or t.dim() != len(sizes):
                return False
            for want, got in zip(sizes, t.shape, strict=True):
                if isinstance(want, int):
                    if want != got:
                        return False
                elif isinstance(want, sympy.Symbol):
                    if bound.setdefault(want, got) != got:
                        return False
                else:
                    later.append((want, got))
        for symbol, value in bound.items():
            low, high = self.ranges.get(symbol, (_TRACED_FROM, None))
            low = max(low, _TRACED_FROM)
            if value < low or (high is not None and value > high):
                return False
        for expr, got in later:  # sizes derived from others (e.g. 2 * s0)
            value = expr.xreplace({s: sympy.Integer(v) for s, v in bound.items()})
            if not value.is_Integer or int(value) != got:
                return False
        return True


@dataclass
class CapturedModel:
    """A model's forward pass as a block-tagged graph."""
    graph_module: torch.fx.GraphModule
    trace: BlockTrace
    signature: inspect.Signature
    placeholders: list[str]  # forward parameter name of each placeholder, in order
    concrete: dict[str, UserInput]  # non-tensor arguments baked into the graph
    loss_nodes: list[torch.fx.Node] = field(default_factory=list)  # identity_loss marks
    checkpoints: int = 0  # recomputation checkpoints in the graph
    # the overlap markers, nodes of the graph until io_markers.finish removes them
    markers: io_markers.GraphMarkers | None = None
    # an exported graph's shapes and dtypes (None: a torch.fx graph, for any shape)
    guard: ShapeGuard | None = None
    tracer: str = "torch.fx"  # what captured it: "torch.export" or "torch.fx"

    def inputs_of(self, args: tuple, kwargs: dict) -> dict[str, UserInput] | None:
        """The placeholder values of one micro-batch, or None when the micro-batch's
        non-tensor arguments differ from those the graph was captured with (or, for an
        exported graph, its tensors' shapes or dtypes: :class:`ShapeGuard`)."""
        try:
            bound = self.signature.bind(*args, **kwargs)
        except TypeError:
            return None
        bound.apply_defaults()
        values = bound.arguments
        for name, value in self.concrete.items():
            if not same_constant(values.get(name), value):
                return None
        inputs = {name: values[name] for name in self.placeholders}
        if self.guard is not None and not self.guard.accepts(
                pytree.tree_leaves([inputs[name] for name in self.placeholders])):
            return None
        return inputs


def is_traced_input(value: object) -> bool:
    """Tensors (and containers of tensors) become graph inputs; the rest is baked in."""
    leaves = pytree.tree_leaves(value)
    return bool(leaves) and all(isinstance(v, torch.Tensor) for v in leaves)


def bind_arguments(signature: inspect.Signature, args: tuple, kwargs: dict
                   ) -> tuple[inspect.BoundArguments, dict[str, UserInput]]:
    """A call's arguments bound (defaults applied), and the non-tensor ones among them
    (baked into the graph); an argument mixing tensors and other values cannot be."""
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    concrete = {n: v for n, v in bound.arguments.items() if not is_traced_input(v)}
    for name, value in concrete.items():
        if any(isinstance(v, torch.Tensor) for v in pytree.tree_leaves(value)):
            raise CaptureUnsupported(f"argument {name!r} holds tensors and other values")
    return bound, concrete


@contextlib.contextmanager
def tracing(listener: markers.BlockListener, overlap: io_markers.GraphMarkers,
            strategy: ExecutionStrategy) -> Iterator[None]:
    """While a capture runs the model: ``listener`` hears the block annotations,
    ``overlap`` the overlap markers, and recomputation checkpoints record nothing."""
    strategy.onStartTracing()
    previous_checker = context.set_overlap_checker(overlap)
    try:
        with markers.listening(listener), context.running_on_ipu(), \
                recompute.recording(None):
            yield
    finally:
        context.set_overlap_checker(previous_checker)
        strategy.onEndTracing()


def same_constant(a: object, b: object) -> bool:
    """Whether non-tensor argument ``a`` equals the captured ``b``."""
    try:
        return a is b or bool(a == b)
    except Exception:  # pylint: disable=broad-except
        return False


def record_weight_users(gm: torch.fx.GraphModule, trace: BlockTrace) -> None:
    """Which block uses which parameter / buffer (as ``partition.trace_blocks`` records
    them), read off the block-tagged graph."""
    users = trace.users
    for node in gm.graph.nodes:
        block = node.meta.get(BLOCK_META)
        if block is None:
            continue
        tensors: list[torch.Tensor] = []
        if node.op == "call_module":
            sub = gm.get_submodule(str(node.target))
            tensors += list(sub.parameters()) + list(sub.buffers())
        for arg in node.all_input_nodes:
            if arg.op == "get_attr":
                value = attrgetter(str(arg.target))(gm)
                if isinstance(value, torch.Tensor):
                    tensors.append(value)
        for t in tensors:
            if id(t) in trace.tensor_names:
                blocks = users.setdefault(id(t), [])
                if block not in blocks:
                    blocks.append(block)
    if not trace.sequence:  # a forward with no operation at all
        trace.enter_implicit()
