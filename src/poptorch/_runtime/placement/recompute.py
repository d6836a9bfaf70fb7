"""Recomputation: activations between checkpoints are recomputed in the backward pass.

``poptorch.recomputationCheckpoint`` cuts a training forward pass into *segments*.
While an executor runs a model that uses checkpoints, a dispatch mode records every
operation of the forward pass (a *tape*, holding only the tensors that come from outside
the segment: weights, inputs, earlier checkpoints), and a saved-tensors hook decides
what autograd keeps for the backward pass:

* tensors made inside the segment are dropped when the segment closes; the first
  backward node that needs one replays the segment's tape (no grad, same random
  numbers) and hands the recomputed values out, each freed once used;
* checkpointed tensors and tensors from outside the segment are kept as usual (through
  any enclosing saved-tensors hooks, e.g. ``save_on_cpu``).

The recording starts and stops with the model's forward: hooks on the outermost
module, installed the first time it calls a checkpoint inside an executor (so that
first forward pass is not recomputed; every later one is). A stage of the engine is
recorded by :func:`recording` instead.
"""
from __future__ import annotations

import collections
import contextlib
import sys
import threading
import weakref
from collections.abc import Collection, Hashable, Iterator
from types import FrameType
from typing import NamedTuple, Protocol, cast

import torch
from torch.utils.weak import WeakTensorKeyDictionary

from ...errors import Error
from .. import context
from ..torch_internals import (
    MODULE_CALL_CODE,
    DisableAutocast,
    DisableTorchFunction,
    TorchDispatchMode,
    current_graph_task_id,
    disable_current_modes,
    pytree,
    top_saved_tensors_default_hooks,
)

__all__ = ["ForwardRecording", "checkpoint"]

Ref = tuple[int, int]  # (index of the op in the tape, index of the output tensor)

_state = threading.local()
_hooked_models: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()
_hook_lock = threading.Lock()


class _Operator(Protocol):
    """An ATen operator overload (``torch._ops.OpOverload``), as the tape reads it: its
    schema and tags, its packet (the overloads of one name), and its call."""

    @property
    def _schema(self) -> torch.FunctionSchema: ...

    @property
    def tags(self) -> list[torch.Tag]: ...

    @property
    def overloadpacket(self) -> Hashable: ...

    def __call__(self, *args: object, **kwargs: object) -> object: ...


def checkpoint(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Mark ``tensors`` as kept for the backward pass and start a new segment.

    Outside a training forward pass of an executor this does nothing.
    """
    recording = getattr(_state, "recording", None)
    if recording is not None:
        recording.checkpoint(tensors)
    elif context.is_running_on_ipu() and not torch.compiler.is_compiling():
        _hook_outermost_module()
    return tensors


def checkpoint_values(*tensors: torch.Tensor) -> tuple:
    """The checkpoint as a node of a captured stage graph (``capture.py``): starts a
    new segment of the stage's recording (:func:`recording`), if one runs."""
    recording = getattr(_state, "recording", None)
    if recording is not None:
        recording.checkpoint(list(tensors))
    return tensors


@contextlib.contextmanager
def recording(owner: torch.nn.Module | None) -> Iterator[None]:
    """Record the forward pass of ``owner`` (one stage of the engine) in this thread,
    cut into segments by :func:`checkpoint_values`. ``owner=None``: swallow checkpoint
    calls (while a model is captured, no hooks are installed)."""
    previous = getattr(_state, "recording", None)
    rec = _Swallow() if owner is None else ForwardRecording(owner)
    _state.recording = rec
    if isinstance(rec, ForwardRecording):
        rec.start()
    try:
        yield
    finally:
        _state.recording = previous
        if isinstance(rec, ForwardRecording):
            rec.finish()


class _Swallow:
    def checkpoint(self, tensors: list[torch.Tensor]) -> None:
        return None


# ---------------------------------------------------------------- forward boundaries
def _hook_outermost_module() -> None:
    """Install the recording hooks on the outermost module running on this thread."""
    frame: FrameType | None = sys._getframe(2)
    model = None
    while frame is not None:
        if frame.f_code is MODULE_CALL_CODE:
            candidate = frame.f_locals.get("self")
            if isinstance(candidate, torch.nn.Module):
                model = candidate
        frame = frame.f_back
    if model is not None:
        hook_model(model)


def hook_model(model: torch.nn.Module) -> None:
    """Record every later training forward pass of ``model`` in segments (once)."""
    with _hook_lock:
        if model in _hooked_models:
            return
        _hooked_models.add(model)
    model.register_forward_pre_hook(start_forward_hook)
    model.register_forward_hook(end_forward_hook, always_call=True)


def start_forward_hook(module: torch.nn.Module, args: tuple) -> None:
    """Forward pre-hook of a hooked model (told from a user's hooks by ``capture.py``)."""
    recording = getattr(_state, "recording", None)
    if recording is not None:
        if recording.owner is module:
            recording.depth += 1
        return
    if context.is_running_on_ipu() and torch.is_grad_enabled():
        _state.recording = ForwardRecording(module)
        _state.recording.start()


def end_forward_hook(module: torch.nn.Module, args: tuple, output: object) -> None:
    recording = getattr(_state, "recording", None)
    if recording is None or recording.owner is not module:
        return
    if recording.depth > 0:
        recording.depth -= 1
        return
    _state.recording = None
    recording.finish()


# ---------------------------------------------------------------- one forward pass
class ForwardRecording:
    """Records one forward pass of ``owner`` cut into segments at checkpoints."""

    def __init__(self, owner: torch.nn.Module) -> None:
        self.owner = owner
        self.depth = 0
        self.checkpoints = 0
        self.outer = top_saved_tensors_default_hooks(True)
        self.segment = _Segment(self.outer)
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
        self._mode = _TapeMode(self)

    def start(self) -> None:
        self._hooks.__enter__()
        self._mode.__enter__()

    def finish(self) -> None:
        try:
            self._mode.__exit__(None, None, None)
            self._hooks.__exit__(None, None, None)
        finally:
            self.segment.close(recompute=self.checkpoints > 0)

    def checkpoint(self, tensors: list[torch.Tensor]) -> None:
        self.checkpoints += 1
        self.segment.keep(tensors)
        self.segment.close(recompute=True)
        self.segment = _Segment(self.outer)

    def _pack(self, tensor: torch.Tensor) -> _Kept | _Pending:
        return self.segment.pack(tensor)


class _TapeMode(TorchDispatchMode):
    """Appends every operation to the open segment's tape."""

    def __init__(self, recording: ForwardRecording) -> None:
        super().__init__()
        self.recording = recording

    def __torch_dispatch__(self, func: _Operator, types: Collection[type],
                           args: tuple[object, ...] = (),
                           kwargs: dict[str, object] | None = None) -> object:
        kwargs = kwargs or {}
        if _leaves_no_tensor_trace(func):
            # Name scopes (push / pop_name_scope, NameScope's profiler range): they
            # change no tensor, so a replay does not need them, and replaying one half
            # of a pair (a scope opened before a checkpoint, closed after it) would
            # unbalance the thread's scope stack.
            return func(*args, **kwargs)
        segment = self.recording.segment
        entry = segment.before(func, args, kwargs)
        out = func(*args, **kwargs)
        segment.after(entry, out)
        return out


# ---------------------------------------------------------------- saved tensors
class _Kept:
    """A saved tensor kept as usual (optionally through the enclosing hooks)."""

    __slots__ = ("payload", "tensor", "unpack", "version")

    def __init__(self, tensor: torch.Tensor, outer: tuple | None) -> None:
        self.version = tensor._version
        self.tensor: torch.Tensor | None
        if outer is None:
            self.tensor, self.payload, self.unpack = tensor, None, None
        else:
            self.tensor, self.payload, self.unpack = None, outer[0](tensor), outer[1]

    def get(self) -> torch.Tensor:
        if self.unpack is not None:
            return self.unpack(self.payload)
        tensor = cast(torch.Tensor, self.tensor)  # (kept itself: no enclosing hooks)
        if tensor._version != self.version:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified "
                f"by an inplace operation: it is at version {tensor._version}; "
                f"expected version {self.version} instead.")
        return tensor


class _Pending:
    """A tensor made inside a segment: held until the segment closes, then either
    kept or dropped (and recomputed when unpacked)."""

    __slots__ = ("__weakref__", "kept", "ref", "segment", "tensor")

    def __init__(self, segment: _Segment, ref: Ref, tensor: torch.Tensor) -> None:
        self.segment = segment
        self.ref = ref
        self.tensor: torch.Tensor | None = tensor
        self.kept: _Kept | None = None

    def get(self) -> torch.Tensor:
        if self.kept is not None:
            return self.kept.get()
        if self.tensor is not None:  # unpacked before its segment closed
            return self.tensor
        return self.segment.recomputed(self.ref)


def _unpack(saved: _Kept | _Pending) -> torch.Tensor:
    return saved.get()


# ---------------------------------------------------------------- the tape
class _Segment:
    """The tape of the operations between two checkpoints, and its saved tensors."""

    def __init__(self, outer: tuple | None) -> None:
        self.outer = outer
        self.ops: list[tuple] = []  # (func, leaves, spec)
        self.binding = WeakTensorKeyDictionary()  # tensor made here -> Ref
        self.externals: list[torch.Tensor] = []
        self.external_index: dict[int, int] = {}
        self.snapshots: dict[int, torch.Tensor] = {}  # external -> value before a write
        self.versions: list[int] = []
        self.rng: tuple | None = None  # (op index, cpu state, cuda states)
        self.pending: list[_Pending] = []
        self.kept_refs: set = set()
        self.wanted: collections.Counter = collections.Counter()
        self.cache: dict[Ref, torch.Tensor] = {}
        self.left: collections.Counter = collections.Counter()
        self.drop_after: list[list[Ref]] = []

    # recording ------------------------------------------------------------------
    def before(self, func: _Operator, args: tuple, kwargs: dict) -> tuple:
        """Record the call of ``func`` (an aten operator overload: its schema and tags
        are read) before it runs; returns the tape entry (see :meth:`after`)."""
        leaves, spec = pytree.tree_flatten((args, kwargs))
        writes = _written_leaves(func, args, kwargs)
        refs = []
        for n, leaf in enumerate(leaves):
            if not isinstance(leaf, torch.Tensor):
                refs.append(leaf)
                continue
            ref = self.binding.get(leaf)
            if ref is not None:
                if n in writes:
                    self._check_not_external_view(leaf)
                refs.append(_Internal(ref))
                continue
            index = self._external(leaf)
            if n in writes and index not in self.snapshots:
                self.snapshots[index] = leaf.detach().clone()
            refs.append(_External(index))
        if self.rng is None and torch.Tag.nondeterministic_seeded in func.tags:
            cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
            self.rng = (len(self.ops), torch.get_rng_state(), cuda)
        return func, refs, spec

    def after(self, entry: tuple, out: object) -> None:
        i = len(self.ops)
        self.ops.append(entry)
        outputs = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        for j, t in enumerate(outputs):
            self.binding[t] = (i, j)

    def _check_not_external_view(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage().data_ptr()
        if any(t.untyped_storage().data_ptr() == storage for t in self.externals):
            raise Error(
                "An in-place update of a view of a tensor made before this recomputation "
                "segment (before the last poptorch.recomputationCheckpoint) cannot be "
                "recomputed. Update a copy instead (e.g. x = x.clone() before the update).")

    def _external(self, tensor: torch.Tensor) -> int:
        index = self.external_index.get(id(tensor))
        if index is None:
            index = len(self.externals)
            self.externals.append(tensor)
            self.external_index[id(tensor)] = index
        return index

    def pack(self, tensor: torch.Tensor) -> _Kept | _Pending:
        ref = self.binding.get(tensor)
        if ref is None:
            return _Kept(tensor, self.outer)
        pending = _Pending(self, ref, tensor)
        self.pending.append(pending)
        return pending

    def keep(self, tensors: list[torch.Tensor]) -> None:
        for t in tensors:
            ref = self.binding.get(t)
            if ref is not None:
                self.kept_refs.add(ref)

    def close(self, recompute: bool) -> None:
        """Decide for every tensor saved in this segment: keep it or recompute it."""
        for pending in self.pending:
            if not recompute or pending.ref in self.kept_refs:
                # (its tensor is held until the segment closes)
                pending.kept = _Kept(cast(torch.Tensor, pending.tensor), self.outer)
            else:
                self.wanted[pending.ref] += 1
            pending.tensor = None
        self.pending = []
        self.binding = WeakTensorKeyDictionary()
        self.versions = [t._version for t in self.externals]
        if self.wanted:
            self._plan_frees()
        else:  # nothing to recompute: the tape is not needed
            self.ops, self.externals, self.snapshots = [], [], {}
        self.external_index = {}

    def _plan_frees(self) -> None:
        last_use: dict[Ref, int] = {}
        for i, (_, refs, _) in enumerate(self.ops):
            for r in refs:
                if isinstance(r, _Internal):
                    last_use[r.ref] = i
        self.drop_after = [[] for _ in self.ops]
        for ref, i in last_use.items():
            if ref not in self.wanted:
                self.drop_after[i].append(ref)

    # replay ---------------------------------------------------------------------
    def recomputed(self, ref: Ref) -> torch.Tensor:
        """The recomputed value of ``ref`` (replays the tape on first use)."""
        if ref not in self.cache:
            self.cache = self._replay()
            self.left = collections.Counter(self.wanted)
        value = self.cache[ref]
        self.left[ref] -= 1
        if self.left[ref] <= 0:
            del self.cache[ref]
        return value

    def _replay(self) -> dict[Ref, torch.Tensor]:
        if torch.is_grad_enabled() and current_graph_task_id() != -1:
            raise Error("Recomputation does not support a backward pass with "
                        "create_graph=True (double backward): remove the "
                        "poptorch.recomputationCheckpoint calls for this model.")
        for index, (tensor, version) in enumerate(zip(self.externals, self.versions, strict=False)):
            if index not in self.snapshots and tensor._version != version:
                raise Error(
                    "A tensor used by a recomputed part of the model (between "
                    "poptorch.recomputationCheckpoint calls) was modified in place after "
                    "the forward pass, so the activations cannot be recomputed. Avoid the "
                    "in-place update, or pass that tensor to recomputationCheckpoint.")
        externals = [self.snapshots[i].clone() if i in self.snapshots else t
                     for i, t in enumerate(self.externals)]
        values: dict[Ref, torch.Tensor] = {}
        # the generators take the recorded state before the tape's first random op
        # (the ops before it draw nothing) and get theirs back after the replay
        rng = self.rng
        cuda = [] if rng is None or rng[2] is None else list(range(len(rng[2])))
        with torch.no_grad(), disable_current_modes(), DisableTorchFunction(), \
                DisableAutocast(), torch.random.fork_rng(cuda, enabled=rng is not None):
            for i, (func, refs, spec) in enumerate(self.ops):
                if rng is not None and rng[0] == i:
                    torch.set_rng_state(rng[1])
                    if rng[2] is not None:
                        torch.cuda.set_rng_state_all(rng[2])
                leaves = [values[r.ref] if isinstance(r, _Internal) else
                          externals[r.slot] if isinstance(r, _External) else r
                          for r in refs]
                args, kwargs = pytree.tree_unflatten(leaves, spec)
                out = func(*args, **kwargs)
                outputs = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
                for j, t in enumerate(outputs):
                    values[(i, j)] = t
                for ref in self.drop_after[i]:
                    values.pop(ref, None)
        return {ref: values[ref] for ref in self.wanted}


class _Internal(NamedTuple):  # a tape argument made earlier in the segment
    ref: Ref


class _External(NamedTuple):  # a tape argument from outside the segment
    slot: int  # in the segment's externals


#: per operator: whether it returns a tensor, the positions and names of the arguments
#: it writes to (its schema's, and those of _UNANNOTATED_WRITES)
_schema_cache: dict[_Operator, tuple[bool, frozenset, frozenset]] = {}
# Ops that update their running statistics without saying so in their schema.
_UNANNOTATED_WRITES: dict[Hashable, tuple[str, ...]] = {
    torch.ops.aten.native_batch_norm: ("running_mean", "running_var"),
    torch.ops.aten.cudnn_batch_norm: ("running_mean", "running_var"),
    torch.ops.aten.miopen_batch_norm: ("running_mean", "running_var"),
}


def _schema_facts(func: _Operator) -> tuple[bool, frozenset, frozenset]:
    cached = _schema_cache.get(func)
    if cached is None:
        arguments = func._schema.arguments
        extra = _UNANNOTATED_WRITES.get(func.overloadpacket, ())
        positions = frozenset(n for n, a in enumerate(arguments)
                              if (a.alias_info is not None and a.alias_info.is_write)
                              or a.name in extra)
        cached = _schema_cache[func] = (
            any("Tensor" in str(r.type) for r in func._schema.returns), positions,
            frozenset(arguments[n].name for n in positions))
    return cached


def _leaves_no_tensor_trace(func: _Operator) -> bool:
    """True for an operator that returns no tensor and writes to none of its arguments
    (by its schema): nothing a replay computes can depend on it."""
    returns_tensor, writes, _ = _schema_facts(func)
    return not returns_tensor and not writes


def _written_leaves(func: _Operator, args: tuple, kwargs: dict) -> set:
    """Leaf positions (in the flattened ``(args, kwargs)``) of the arguments that
    ``func`` writes to (from its schema, e.g. ``self`` of ``add_``, ``out=``)."""
    _, positions, names = _schema_facts(func)
    if not positions:
        return set()
    written: set = set()
    leaf = 0
    for key, value in [*enumerate(args), *kwargs.items()]:
        count = len(pytree.tree_leaves(value))
        if key in positions or key in names:
            written.update(range(leaf, leaf + count))
        leaf += count
    return written

