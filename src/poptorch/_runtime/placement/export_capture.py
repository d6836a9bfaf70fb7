"""Capture with ``torch.export`` (non-strict: the model's Python, hooks included, runs
once on fake tensors of the call's real shapes), so ordinary code captures
(``torch.zeros(x.shape[0], 1, device=x.device)``, loops over sizes, ``len(x)``).

Export records ATen operators only. The block annotations report to
:class:`_BlockAnnotator`, which annotates every node recorded afterwards with its block
(``fx_traceback.annotate``: ``meta["custom"]``); checkpoints and overlap markers are
recorded as the operators of ``capture_ops.py``; the losses ``identity_loss`` marks
become extra outputs. :func:`export_model` then rebuilds the program as the graph the
fx capture makes: one placeholder per forward parameter, the model's own weights as
``get_attr`` nodes (no copy), the model's output structure, ``checkpoint_values`` and
overlap marker nodes.

Dimension 0 of every input (the batch) is symbolic where the model allows it
(``Dim.AUTO``: from 2 up, as export traces sizes other than 0 and 1), so one graph runs
the call's example and its micro-batches, each checked by :class:`~.captured.ShapeGuard`.
A device baked in from the example stands for the device of the node's stage
(:func:`_stage_devices`). A ``torch.autograd.Function`` whose backward reaches the
model's gradients cannot be kept (:class:`~.captured.CustomBackward`).
"""
from __future__ import annotations

import contextlib
import inspect
import io
import operator
from collections.abc import Iterator
from typing import cast

import sympy
import torch
import torch.fx
import torch.fx.traceback as fx_traceback
from torch.export import Dim, ExportedProgram
from torch.export.graph_signature import InputKind, InputSpec, OutputKind, OutputSpec

from ..._logging import quiet_logger
from ..._typing import UserInput, UserOutput
from .. import context
from ..attributes import attribute_table
from ..program.loss import autograd_nodes
from ..torch_internals import pytree
from . import capture_ops, io_markers, recompute
from .captured import (
    BLOCK_META,
    CapturedModel,
    CaptureUnsupported,
    CustomBackward,
    ShapeGuard,
    bind_arguments,
    record_weight_users,
    tracing,
)
from .partition import IMPLICIT_BLOCK, BlockRecorder, BlockTrace
from .strategy import ExecutionStrategy

_ROOT = "model"  # the model's attribute name in the exported wrapper
_CUSTOM = "custom"  # the node meta key fx_traceback.annotate fills
# The backward nodes of torch.library operators (export keeps those operators, so
# their backward runs) are named so; a user's torch.autograd.Function's are not.
_LIBRARY_BACKWARD = "GeneratedBackwardFor_"


class _BlockAnnotator(BlockRecorder):
    """Block listener while a model is exported: annotates the nodes recorded from now
    on with the current block."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(model)
        self.training = model.training
        self._scope = contextlib.ExitStack()
        # the model's output structure, kept as it runs (here: export restores the
        # exported module's own attributes): its leaves (traced ones: None), its spec
        self.output: list[UserOutput] = []  # [the leaves, their pytree spec]

    def begin_block(self, user_id: str | int | None, ipu_id: int | None,
                    layer: torch.nn.Module | None = None) -> None:
        super().begin_block(user_id, ipu_id, layer=layer)
        self.tag(self.current)

    def tag(self, block: str | None) -> None:
        """Annotate the nodes recorded from now on with ``block``."""
        self._scope.close()
        self._scope = contextlib.ExitStack()
        self._scope.enter_context(fx_traceback.annotate({BLOCK_META: block}))

    def close(self) -> None:
        self._scope.close()

    def checkpoint(self, tensors: list) -> list:
        """A recomputation checkpoint: a ``capture_ops.checkpoint`` node, replaced
        with ``recompute.checkpoint_values`` once exported."""
        self.checkpoints += 1
        return list(capture_ops.checkpoint(list(tensors)))


class _Forward(torch.nn.Module):
    """What is exported: the model called with the traced arguments (the non-tensor
    ones baked in), returning its output's traced leaves and the marked losses."""

    def __init__(self, model: torch.nn.Module, signature: inspect.Signature,
                 names: list[str], concrete: dict[str, UserInput],
                 listener: _BlockAnnotator) -> None:
        super().__init__()
        setattr(self, _ROOT, model)
        self.signature = signature
        self.names = names
        self.concrete = concrete
        self.listener = listener

    def forward(self, values: tuple) -> tuple:
        arguments = dict(self.concrete)
        arguments.update(zip(self.names, values, strict=True))
        ordered = {n: arguments[n] for n in self.signature.parameters if n in arguments}
        bound = inspect.BoundArguments(self.signature, ordered)
        marked = context.marked_losses()
        before = len(marked)
        self.listener.tag(IMPLICIT_BLOCK)  # (code before the first block)
        try:
            out = getattr(self, _ROOT)(*bound.args, **bound.kwargs)
        finally:
            self.listener.close()
        losses = tuple(marked[before:])
        del marked[before:]
        leaves, spec = pytree.tree_flatten(out)
        traced = tuple(v for v in leaves if isinstance(v, (torch.Tensor, torch.SymInt)))
        self.listener.output = [[None if isinstance(v, (torch.Tensor, torch.SymInt)) else v
                           for v in leaves], spec]
        _refuse_custom_backward(traced + losses)
        return traced, losses


def _refuse_custom_backward(tensors: tuple) -> None:
    """Raise when the autograd graph of ``tensors`` holds the backward of a
    ``torch.autograd.Function`` (an exported graph records its forward only)."""
    for fn in autograd_nodes(t.grad_fn for t in tensors if isinstance(t, torch.Tensor)):
        if isinstance(fn, torch.autograd.function.BackwardCFunction) and not type(
                fn).__name__.startswith(_LIBRARY_BACKWARD):
            raise CustomBackward(
                f"the forward calls a torch.autograd.Function ({type(fn).__name__}), whose "
                "backward a captured graph cannot keep (torch.export and torch.fx record "
                "its forward only); to pipeline it, register the operation with "
                "torch.library.custom_op and register_autograd instead")


def export_model(model: torch.nn.Module, args: tuple, kwargs: dict,
                 strategy: ExecutionStrategy) -> CapturedModel:
    """``model`` captured with ``torch.export`` for calls like ``(args, kwargs)``, its
    overlap markers still nodes of the graph (for ``io_markers.finish``); raises
    whatever stopped the export."""
    signature = inspect.signature(model.forward)
    bound, concrete = bind_arguments(signature, args, kwargs)
    names = [n for n in bound.arguments if n not in concrete]
    values = tuple(bound.arguments[n] for n in names)
    listener = _BlockAnnotator(model)
    wrapper = _Forward(model, signature, names, concrete, listener)
    overlap = io_markers.ExportMarkers(dict(bound.arguments), model.forward, args, kwargs)
    with _listening(listener, overlap, strategy), _quiet(), _same_attributes(model):
        program = torch.export.export(wrapper, (values, ),
                                      dynamic_shapes=(_batch_dims(values), ),
                                      strict=False)
    return _rebuild(program, model, wrapper, listener, overlap, signature, names,
                    concrete, values)


@contextlib.contextmanager
def _same_attributes(model: torch.nn.Module) -> Iterator[None]:
    """Give every module of ``model`` its own attribute objects back after the export:
    non-strict export puts copies of the containers it finds (a ``self.flags`` dict,
    a list) in their place, which would cut them off from the user's references."""
    before = [(m, attribute_table(m)) for m in model.modules()]
    try:
        yield
    finally:
        for module, attributes in before:
            now = attribute_table(module)
            for name, value in attributes.items():
                if now.get(name, value) is not value:
                    object.__setattr__(module, name, value)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Keep a failed export's report (its partial graph, printed to stderr, and its
    error log) from the user: the capture says why in one INFO line instead."""
    with quiet_logger("torch.export._trace"), contextlib.redirect_stderr(io.StringIO()):
        yield


def _batch_dims(values: tuple) -> tuple[object, ...]:
    """``dynamic_shapes`` of ``values``: dimension 0 of each tensor ``Dim.AUTO`` (symbolic
    from 2 up, where the model does not fix it; a size of 1 is traced as a constant)."""
    def spec(t: torch.Tensor) -> dict[int, object] | None:
        return None if t.dim() == 0 else {0: Dim.AUTO}
    return tuple(pytree.tree_map_only(torch.Tensor, spec, v) for v in values)


@contextlib.contextmanager
def _listening(listener: _BlockAnnotator, overlap: io_markers.ExportMarkers,
               strategy: ExecutionStrategy) -> Iterator[None]:
    """The block listener, the overlap checker and node annotations while exporting."""
    # (a training model's autograd graph shows the torch.autograd.Functions whose
    # backward matters, even when it is captured under no_grad; what autograd saves of
    # the fake tensors reaches no saved-tensors hook of the caller's)
    with tracing(listener, overlap, strategy), contextlib.closing(listener), \
            fx_traceback.preserve_node_meta(), torch.set_grad_enabled(
                torch.is_grad_enabled() or listener.training), \
            torch.autograd.graph.saved_tensors_hooks(_same, _same):
        yield


#: PopTorch's name scope operators: names for the profiler only, that open in one
#: block and close in another; the stages run without them (as the fx capture did)
_NAME_SCOPE_OPS = ("poptorch::push_name_scope", "poptorch::pop_name_scope")


def _is_name_scope(target: object) -> bool:
    name = getattr(target, "name", None)  # (an operator's: "namespace::name")
    return hasattr(target, "overloadpacket") and callable(name) \
        and name() in _NAME_SCOPE_OPS


def _same(value: torch.Tensor) -> torch.Tensor:
    return value


def _rebuild(program: ExportedProgram, model: torch.nn.Module, wrapper: _Forward,
             listener: _BlockAnnotator, overlap: io_markers.ExportMarkers,
             signature: inspect.Signature, names: list[str], concrete: dict[str, UserInput],
             values: tuple) -> CapturedModel:
    """The exported program as the graph the stage split reads (module docstring)."""
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    attrs: dict[str, object] = {}  # get_attr target -> value (the model's own tensors)
    user_leaves = _input_leaves(graph, names, values)
    specs = {spec.arg.name: spec for spec in program.graph_signature.input_specs
             if hasattr(spec.arg, "name")}
    prefix = _ROOT + "."
    loss_nodes: list[torch.fx.Node] = []
    for node in program.graph.nodes:
        if node.op == "placeholder":
            env[node] = _input_node(graph, specs[node.name], program, user_leaves, attrs,
                                    model, prefix)
            env[node].meta.update(node.meta)
        elif node.op == "get_attr":  # (submodules of higher-order operators)
            name = f"_poptorch_export_{node.target}"
            attrs[name] = getattr(program.graph_module, str(node.target))
            env[node] = graph.get_attr(name)
        elif node.op == "output":
            loss_nodes = _output(graph, program, node, env, wrapper)
        elif _is_name_scope(node.target):
            continue  # (a stage's thread would close a scope another one opened)
        elif capture_ops.is_checkpoint(node.target):
            env[node] = graph.call_function(recompute.checkpoint_values,
                                            tuple(env[a] for a in node.args[0]))
            env[node].meta.update(node.meta)
        elif capture_ops.is_overlap_marker(node.target):
            env[node] = overlap.adopt(graph, int(node.args[1]), env[node.args[0]])
            env[node].meta.update(node.meta)
        else:
            env[node] = graph.node_copy(node, lambda n: env[n])
    if user_leaves:
        raise CaptureUnsupported("the exported program reads fewer inputs than given")
    trace = listener.block_trace
    _tag_blocks(graph, trace)
    example_device = next((leaf.device for leaf in pytree.tree_leaves(values)
                           if isinstance(leaf, torch.Tensor)), torch.device("cpu"))
    _stage_devices(graph, example_device, model)
    gm = torch.fx.GraphModule(attrs, graph, class_name=type(model).__name__ + "Captured")
    record_weight_users(gm, trace)
    return CapturedModel(gm, trace, signature, list(names), concrete, loss_nodes,
                         listener.checkpoints, overlap, _guard(program), "torch.export")


def _input_leaves(graph: torch.fx.Graph, names: list[str], values: tuple
                  ) -> list[torch.fx.Node]:
    """One placeholder per traced forward parameter, and the nodes picking its
    tensors out of it (``getitem``), in the order export flattens them."""
    leaves = []
    for name, value in zip(names, values, strict=True):
        root = graph.placeholder(name)
        for path, _ in pytree.tree_flatten_with_path(value)[0]:
            node = root
            for key in path:
                if isinstance(key, pytree.SequenceKey):
                    node = graph.call_function(operator.getitem, (node, key.idx))
                elif isinstance(key, pytree.MappingKey):
                    node = graph.call_function(operator.getitem, (node, key.key))
                elif isinstance(key, pytree.GetAttrKey):
                    node = graph.call_function(getattr, (node, key.name))
                else:
                    raise CaptureUnsupported(f"argument {name!r} nests a {type(key)}")
            leaves.append(node)
    return leaves


def _input_node(graph: torch.fx.Graph, spec: InputSpec, program: ExportedProgram,
                user_leaves: list[torch.fx.Node], attrs: dict[str, object],
                model: torch.nn.Module, prefix: str) -> torch.fx.Node:
    """The node standing for one input of the exported program."""
    target = str(spec.target)
    if spec.kind == InputKind.USER_INPUT:
        if not user_leaves:
            raise CaptureUnsupported("the exported program reads more inputs than given")
        return user_leaves.pop(0)
    if spec.kind in (InputKind.PARAMETER, InputKind.BUFFER) and target.startswith(prefix):
        name = target[len(prefix):]
        attrs[name] = operator.attrgetter(name)(model)
        return graph.get_attr(name)
    if spec.kind == InputKind.CONSTANT_TENSOR:
        name = f"_poptorch_constant_{len(attrs)}"
        attrs[name] = program.constants[target]
        return graph.get_attr(name)
    raise CaptureUnsupported(f"the exported program takes a {spec.kind.name} input")


def _output(graph: torch.fx.Graph, program: ExportedProgram, node: torch.fx.Node,
            env: dict[torch.fx.Node, torch.fx.Node], wrapper: _Forward
            ) -> list[torch.fx.Node]:
    """The model's output structure as the output node; the in-place updates of
    buffers and inputs export moved to the outputs as ``copy_`` nodes; returns the
    loss nodes."""
    results: list[torch.fx.node.Argument] = []
    returned = node.args[0]
    assert isinstance(returned, (tuple, list))  # (an exported graph returns a tuple)
    for spec, value in zip(program.graph_signature.output_specs, returned, strict=True):
        mapped = env[value] if isinstance(value, torch.fx.Node) else value
        if spec.kind == OutputKind.USER_OUTPUT:
            results.append(mapped)
        elif spec.kind in (OutputKind.BUFFER_MUTATION, OutputKind.USER_INPUT_MUTATION):
            dest = _mutated(graph, program, spec, env)
            copy = graph.call_function(torch.ops.aten.copy_.default, (dest, mapped))
            copy.meta[_CUSTOM] = dict(getattr(value, "meta", {}).get(_CUSTOM, {}))
        else:
            raise CaptureUnsupported(f"the exported program outputs a {spec.kind.name}")
    out_leaves, out_spec = wrapper.listener.output
    n_losses = len(results) - sum(1 for v in out_leaves if v is None)
    traced = iter(results[:len(results) - n_losses])
    leaves = [next(traced) if v is None else v for v in out_leaves]
    structure = pytree.tree_unflatten(leaves, out_spec)
    try:
        graph.output(structure)
    except Exception as exc:  # pylint: disable=broad-except
        raise CaptureUnsupported(f"the model's output ({type(structure).__name__}) is no "
                                 f"graph value: {exc}") from None
    losses = results[len(results) - n_losses:]
    if not all(isinstance(v, torch.fx.Node) for v in losses):
        raise CaptureUnsupported("a loss was marked with a value that is not traced")
    return cast(list[torch.fx.Node], losses)


def _mutated(graph: torch.fx.Graph, program: ExportedProgram, spec: OutputSpec,
             env: dict[torch.fx.Node, torch.fx.Node]) -> torch.fx.Node:
    """The node of the buffer or input an exported in-place update writes."""
    target = str(spec.target)
    signature = program.graph_signature
    for node in program.graph.nodes:
        if node.op != "placeholder":
            continue
        if signature.inputs_to_buffers.get(node.name) == target or node.name == target:
            return env[node]
    raise CaptureUnsupported(f"the exported program updates {target!r}, not found")


def _tag_blocks(graph: torch.fx.Graph, trace: BlockTrace) -> None:
    """Set every operation's block (``BLOCK_META``) from its annotation; an operation
    recorded outside any annotation (a size read when the inputs were made, the
    ``getitem`` picking an input) takes the block of its first user."""
    order = {n: i for i, n in enumerate(graph.nodes)}.__getitem__
    for node in reversed(graph.nodes):
        if node.op in ("placeholder", "get_attr", "output") or io_markers.is_marker(
                node.target):
            continue
        custom = node.meta.get(_CUSTOM) or {}
        block = custom.get(BLOCK_META)
        if block is None:
            block = next((u.meta[BLOCK_META] for u in sorted(node.users, key=order)
                          if BLOCK_META in u.meta), None)
        if block is None:
            block = trace.sequence[0] if trace.sequence else IMPLICIT_BLOCK
        node.meta[BLOCK_META] = block
        if block == IMPLICIT_BLOCK and IMPLICIT_BLOCK not in trace.ipu_of:
            trace.enter_implicit()


def _stage_devices(graph: torch.fx.Graph, device: torch.device,
                   model: torch.nn.Module) -> None:
    """A ``device`` argument that export baked in from the example (the device the
    inputs and weights had) stands for the device of the node's stage: it becomes the
    device of a tensor that stage already holds (one it made or reads before the node,
    or one of its weights)."""
    reads: dict[str, set[torch.fx.Node]] = {}
    for node in graph.nodes:
        block = node.meta.get(BLOCK_META)
        if block is not None:
            reads.setdefault(block, set()).update(node.all_input_nodes)
    held: list[torch.fx.Node] = []  # tensors on the example's device, in graph order
    for node in list(graph.nodes):
        block = node.meta.get(BLOCK_META)
        baked = node.kwargs.get("device") if node.op == "call_function" else None
        if block is not None and isinstance(baked, torch.device) and baked == device:
            anchor = next((h for h in reversed(held) if h.meta.get(BLOCK_META) == block
                           or h in reads[block]), None)
            if anchor is not None:
                with graph.inserting_before(node):
                    where = graph.call_function(getattr, (anchor, "device"))
                where.meta[BLOCK_META] = block
                node.update_kwarg("device", where)
        if _holds_tensor(node, device, model):
            held.append(node)


def _holds_tensor(node: torch.fx.Node, device: torch.device,
                  model: torch.nn.Module) -> bool:
    if node.op == "get_attr":  # the model's own weights (placed with their stage)
        target = str(node.target)
        return not target.startswith("_poptorch_") and isinstance(
            operator.attrgetter(target)(model), torch.Tensor)
    value = node.meta.get("val")
    return isinstance(value, torch.Tensor) and value.device == device


def _guard(program: ExportedProgram) -> ShapeGuard:
    """The shapes and dtypes of the exported program's tensor inputs."""
    dtypes: list[torch.dtype] = []
    sizes: list[tuple[int | sympy.Expr, ...]] = []
    users = {spec.arg.name for spec in program.graph_signature.input_specs
             if spec.kind == InputKind.USER_INPUT and hasattr(spec.arg, "name")}
    for node in program.graph.nodes:
        if node.op == "placeholder" and node.name in users:
            value = node.meta["val"]
            dtypes.append(value.dtype)
            sizes.append(tuple(_size(d) for d in value.shape))
    ranges: dict[sympy.Symbol, tuple[int, int | None]] = {}
    for symbol, limits in program.range_constraints.items():
        if isinstance(symbol, sympy.Symbol):
            ranges[symbol] = (_bound(limits.lower) or 0, _bound(limits.upper))
    return ShapeGuard(dtypes, sizes, ranges)


def _size(d: int | torch.SymInt) -> int | sympy.Expr:
    if isinstance(d, int):
        return d
    expr = d.node.expr
    return int(expr) if expr.is_Integer else expr


def _bound(value: int | sympy.Expr) -> int | None:
    """``value`` (a range's bound) as an int; None when unbounded."""
    if isinstance(value, int):
        return value
    return int(value) if getattr(value, "is_Integer", False) else None
