"""The optimizer step with its state sharded over replicas and / or kept off chip.

The idea of ``torch.distributed.optim.ZeroRedundancyOptimizer`` (ZeRO stage 1) over
PopTorch's layout (``layout.py``): after the gradients of a step are reduced over every
replica (DDP's all-reduce, unchanged), each process updates only the pieces of each
parameter whose optimizer state it holds, and the updated pieces are all-gathered so
that every process has the whole new weights. The user's optimizer itself runs the
update: for the duration of the step its ``param_groups`` hold *piece parameters*
(views into the real parameters' storage, so the update writes the weights in place)
and its ``state`` holds the pieces' state. Loss scaling, velocity scaling, accumulator
dtypes, stochastic rounding and the hyperparameters in force are therefore the
optimizer's own; ``max_grad_norm`` clips with the norm over all pieces of all processes.

Between steps the optimizer's ``state`` is empty: each process holds only its pieces
(here, in ``ManagedStep.state``). ``optimizer.state_dict()`` gathers the whole state
(a collective: every process must call it, as for FSDP's full state dict) into the
optimizer, in PopTorch's shape, until the next step; a state loaded with
``load_state_dict`` is split into the pieces at the next step, so a checkpoint
resumes at any world size and with or without sharding.
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ..._typing import StateValue
from ..attributes import own_attribute
from ..distributed.collectives import failures_as_errors
from ..distributed.world import World
from ..numerics.loss_scaling import PENDING_UNSCALE_ATTR
from ..torch_internals import foreach_copy_
from .layout import Bucket, Piece, ShardLayout
from .offload import StateStorage, chunks

# Parameters whose off-chip state moves to the device together, in elements.
OFFLOAD_CHUNK_ELEMENTS = 16 * 1024 * 1024
_GATHER_HINT = ("optimizer.state_dict() of a sharded optimizer gathers the state of "
                "every process: call it on every process")


# The managed step in force for an optimizer is an attribute of the optimizer: its
# state_dict hook finds it there, and it keeps the pieces alive as long as the
# optimizer (a program compiled again takes them over). (Not a WeakKeyDictionary: the
# step refers to its optimizer, so an entry would keep its own key, the optimizer and
# every weight it steps, alive for good; the attribute makes a cycle that the garbage
# collector frees. Both attributes begin ``_optimizer_``, which torch's and
# poptorch.optim's ``__getstate__`` leave out of copies and pickles, as the hook.)
_MANAGER_ATTR = "_optimizer_poptorch_managed_step"
_HOOKED_ATTR = "_optimizer_poptorch_state_dict_hooked"


def _manager_of(optimizer: torch.optim.Optimizer) -> ManagedStep | None:
    manager: ManagedStep | None = own_attribute(optimizer, _MANAGER_ATTR)
    return manager


def _gather_before_state_dict(optimizer: torch.optim.Optimizer) -> None:
    managed = _manager_of(optimizer)
    if managed is not None:
        managed.gather_into(optimizer)


def take_over(optimizer: torch.optim.Optimizer) -> None:
    """Before a program compiled again for ``optimizer`` steps it: the pieces held by
    the previous program become ``optimizer``'s whole state (a collective)."""
    previous = own_attribute(optimizer, _MANAGER_ATTR)
    if previous is not None:
        object.__delattr__(optimizer, _MANAGER_ATTR)
        previous.gather_into(optimizer)


def state_bytes(state: dict[torch.Tensor, dict[str, StateValue]]) -> int:
    """Bytes of the tensors of an optimizer ``state`` (each storage counted once)."""
    seen = set()
    total = 0
    for entry in state.values():
        for value in entry.values():
            if isinstance(value, torch.Tensor):
                storage = value.untyped_storage()
                if storage.data_ptr() not in seen:
                    seen.add(storage.data_ptr())
                    total += storage.nbytes()
    return total


class ManagedStep:
    """Replaces the device program's optimizer step (see module docstring).

    ``params``: the device model's parameters, the order ``layout`` indexes;
    ``optimizer_of()`` returns the optimizer in force (``setOptimizer`` replaces it).
    """

    def __init__(self, optimizer_of: Any, params: list[torch.nn.Parameter],
                 layout: ShardLayout, world: World, storage: StateStorage,
                 flatten: bool = True) -> None:
        self.optimizer_of = optimizer_of
        self.params = params
        self.index = {id(p): i for i, p in enumerate(params)}
        self.layout = layout
        self.world = world
        self.storage = storage
        self.local: list[Piece] = layout.local(world.rank)
        self.pieces: dict[Piece, torch.nn.Parameter] = {
            piece: torch.nn.Parameter(torch.empty(0), requires_grad=False)
            for piece in self.local}
        self.replicated = set(layout.replicated)
        self.piece_index = {piece: j for j, piece in enumerate(layout.pieces)}
        self.state: dict[torch.Tensor, dict[str, StateValue]] = defaultdict(dict)
        self.moved_on = False  # the pieces stepped since the state was last gathered
        self.opt: Any = None
        self.inner: Any = None
        self.groups: list[list[torch.nn.Parameter]] = []
        self.group_ids: list[tuple] = []
        self.bucket_groups: list[list[list[torch.nn.Parameter]]] = []
        self.rest_groups: list[list[torch.nn.Parameter]] = []
        # The buckets' weights, each in one tensor (the parameters are views into it)
        # so that a bucket is gathered in place; only across processes.
        self.flats: list[torch.Tensor] = []
        if flatten and world.distributed:
            self.flats = [self._flatten(bucket) for bucket in layout.buckets]
        # per (dtype, device): per process, the other pieces it sends, in canonical order
        self.gather_plan = self._gather_plan() if world.distributed else []

    # --- the optimizer in force ----------------------------------------------------
    def _bind(self, opt: Any) -> None:
        from ..program.optimizer import fast_step
        self.opt = opt
        self.inner = fast_step(opt)
        # The hook (registered once per optimizer) finds the step in force on it.
        # (plain attributes: no optimizer __setattr__ runs)
        object.__setattr__(opt, _MANAGER_ATTR, self)
        if not own_attribute(opt, _HOOKED_ATTR):
            object.__setattr__(opt, _HOOKED_ATTR, True)
            opt.register_state_dict_pre_hook(_gather_before_state_dict)
        self._regroup(opt)

    def _regroup(self, opt: Any) -> None:
        """The parameters of each param group during the step: piece parameters of the
        pieces this process holds, whole replicated parameters."""
        by_param: dict[int, list[Piece]] = {}
        for piece in self.local:
            by_param.setdefault(piece.param, []).append(piece)
        self.groups, self.group_ids = [], []
        for group in opt.param_groups:
            members: list[torch.nn.Parameter] = []
            for p in group["params"]:
                i = self.index[id(p)]
                if i in self.replicated:
                    members.append(p)
                else:
                    members.extend(self.pieces[q] for q in by_param.get(i, ()))
            self.groups.append(members)
            self.group_ids.append(tuple(id(p) for p in group["params"]))
        bucket_of = {id(shard): piece.bucket for piece, shard in self.pieces.items()
                     if self.flats}
        self.bucket_groups = [[[m for m in members if bucket_of.get(id(m), -1) == b]
                               for members in self.groups]
                              for b in range(len(self.flats))]
        self.rest_groups = [[m for m in members if bucket_of.get(id(m), -1) == -1]
                            for members in self.groups]

    # --- one step -------------------------------------------------------------------
    @torch.no_grad()
    def __call__(self) -> Any:
        opt = self.optimizer_of()
        if opt is not self.opt:
            self._bind(opt)
        elif any(tuple(id(p) for p in g["params"]) != ids
                 for g, ids in zip(opt.param_groups, self.group_ids, strict=False)) \
                or len(opt.param_groups) != len(self.group_ids):
            self._regroup(opt)
        if any(opt.state.values()):  # loaded (or gathered): the authoritative state
            self._split(opt.state)
        self._point_pieces()
        saved_groups, saved_state = opt.param_groups, opt.state
        clip = self._clip_coefficient(opt)
        max_norm = getattr(opt, "max_grad_norm", None)
        pending: list[Any] = []
        try:
            if clip is not None:
                opt.gradient_override = self._clipped_gradients(opt, clip)
                opt.max_grad_norm = float("inf")
            streamed = [p for g in self.groups for p in g if self.storage.streams(p)]
            if streamed:
                result = self._streamed_step(opt, saved_groups, set(map(id, streamed)))
                pending.extend(self._after_update(b) for b in range(len(self.flats)))
            elif self.flats:
                # Bucket after bucket: the gather of one overlaps the update of the next.
                for b, groups in enumerate(self.bucket_groups):
                    self._step_on(opt, saved_groups, groups)
                    pending.append(self._after_update(b))
                result = self._step_on(opt, saved_groups, self.rest_groups)
            else:
                result = self._step_on(opt, saved_groups, self.groups)
        finally:
            opt.param_groups, opt.state = saved_groups, saved_state
            if clip is not None:
                opt.gradient_override = None
            if clip is not None:
                opt.max_grad_norm = max_norm
            with failures_as_errors("Gathering the updated weight shards"):
                for work in pending:
                    if work is not None:
                        work.wait()
        opt.state = defaultdict(dict)
        self.moved_on = True
        if self.world.distributed:
            self._all_gather_weights()
        return result

    def _step_on(self, opt: Any, groups: list[dict], members: list[list[torch.nn.Parameter]]
                 ) -> Any:
        """The optimizer's step over ``members`` (per param group) with their state."""
        opt.param_groups = [dict(g, params=m) for g, m in zip(groups, members, strict=False) if m]
        opt.state = self.state
        return self.inner() if opt.param_groups else None

    def _point_pieces(self) -> None:
        """Point every piece parameter at its elements of the weight and the gradient
        (the weights' storage can be swapped between steps)."""
        params = self.params
        for piece, shard in self.pieces.items():
            p = params[piece.param]
            grad = p.grad
            if piece.whole:
                shard.data = p.data
                shard.grad = grad
                continue
            shard.data = p.data.view(-1)[piece.start:piece.end]
            if grad is None:
                shard.grad = None
                continue
            view = grad.reshape(-1)[piece.start:piece.end]
            divisor = getattr(grad, PENDING_UNSCALE_ATTR, None)
            if divisor is not None:
                setattr(view, PENDING_UNSCALE_ATTR, divisor)
            shard.grad = view

    def _streamed_step(self, opt: Any, groups: list[dict], streamed: set) -> Any:
        """The update one chunk of parameters at a time, their state fetched from host
        memory to the device and written back (``offload``)."""
        result = None
        storage = self.storage
        devices: set[torch.device] = set()
        for group, members in zip(groups, self.groups, strict=False):
            on_chip = [p for p in members if id(p) not in streamed]
            parts = ([on_chip] if on_chip else []) + chunks(
                [p for p in members if id(p) in streamed], OFFLOAD_CHUNK_ELEMENTS)
            for part in parts:
                moving = [p for p in part if id(p) in streamed]
                state: dict[torch.Tensor, dict[str, StateValue]] = defaultdict(dict)
                for p in part:
                    if p in self.state:
                        state[p] = (storage.fetch(self.state[p], p.device)
                                    if id(p) in streamed else self.state[p])
                opt.param_groups = [dict(group, params=part)]
                opt.state = state
                result = self.inner()
                for p in part:
                    if p in state:
                        if id(p) in streamed:
                            storage.store(self.state[p], state[p])
                        else:
                            self.state[p] = state[p]
                devices.update(p.device for p in moving)
        storage.wait(devices)
        return result

    # --- gradient clipping over all pieces ----------------------------------------
    def _clip_coefficient(self, opt: Any) -> torch.Tensor | None:
        """``max_grad_norm``'s coefficient from the norm over all pieces of all
        processes (None: no clipping, or nothing sharded)."""
        max_norm = getattr(opt, "max_grad_norm", float("inf"))
        if max_norm == float("inf") or not hasattr(opt, "_gradients"):
            return None
        if not self.pieces and not self.storage.off_chip:
            return None
        saved_groups = opt.param_groups
        opt.max_grad_norm = float("inf")
        try:
            opt.param_groups = [dict(g, params=m)
                                for g, m in zip(saved_groups, self.groups, strict=False)]
            grads = type(opt)._gradients(opt)
        finally:
            opt.param_groups = saved_groups
            opt.max_grad_norm = max_norm
        pieces = {id(s) for s in self.pieces.values()}
        dtype = torch.float64
        device = next(iter(grads.values())).device if grads else torch.device("cpu")
        shard_sq = torch.zeros((), dtype=dtype, device=device)
        whole_sq = torch.zeros((), dtype=dtype, device=device)
        for p, g in grads.items():
            sq = torch.linalg.vector_norm(g.float()).to(dtype) ** 2
            if id(p) in pieces:
                shard_sq += sq.to(device)
            else:
                whole_sq += sq.to(device)
        if self.world.distributed:
            with failures_as_errors("Summing the gradient norms of the pieces"):
                dist.all_reduce(shard_sq, group=self.world.group)
        total = torch.sqrt(shard_sq + whole_sq).float()
        return torch.clamp(max_norm / (total + 1e-6), max=1.0)

    @staticmethod
    def _clipped_gradients(opt: Any, coef: torch.Tensor
                           ) -> Callable[[dict[torch.Tensor, torch.Tensor]],
                                         dict[torch.Tensor, torch.Tensor]]:
        def clipped(grads: dict[torch.Tensor, torch.Tensor]
                    ) -> dict[torch.Tensor, torch.Tensor]:
            return {p: g * coef.to(device=g.device, dtype=g.dtype) for p, g in grads.items()}
        return clipped

    # --- weights after the update ---------------------------------------------------
    def _flatten(self, bucket: Bucket) -> torch.Tensor:
        """One tensor holding ``bucket``'s parameters; they become views into it."""
        first = self.params[bucket.params[0]]
        flat = torch.zeros(bucket.length, dtype=first.dtype, device=first.device)
        for i, offset in zip(bucket.params, bucket.offsets, strict=False):
            p = self.params[i]
            view = flat[offset:offset + p.numel()]
            view.copy_(p.data.reshape(-1))
            p.data = view.view(p.shape)
        return flat

    def _after_update(self, b: int) -> Any:
        """Once bucket ``b`` is updated: start gathering it (the work to wait for)."""
        return self._gather_bucket(b)

    def _gather_bucket(self, b: int) -> Any:
        """Start gathering bucket ``b`` in place (every process sends its range)."""
        flat = self.flats[b]
        start, end = self.layout.process_range(self.layout.buckets[b], self.world.rank)
        with failures_as_errors("Gathering the updated weight shards"):
            return dist.all_gather_into_tensor(flat, flat[start:end],
                                               group=self.world.group, async_op=True)

    def _gather_plan(self) -> list[tuple]:
        plan: dict[tuple, list[list[Piece]]] = {}
        for piece in self.layout.pieces:
            if self.flats and piece.bucket >= 0:
                continue
            p = self.params[piece.param]
            per_process = plan.setdefault((p.dtype, p.device),
                                          [[] for _ in range(self.world.size)])
            per_process[self.layout.process_of(piece)].append(piece)
        return list(plan.items())

    def _all_gather_weights(self) -> None:
        """Every process sends its updated pieces and receives everyone else's."""
        params, rank = self.params, self.world.rank
        for (dtype, device), per_process in self.gather_plan:
            sizes = [sum(q.numel for q in pieces) for pieces in per_process]
            longest = max(sizes)
            send = torch.empty(longest, dtype=dtype, device=device)
            offset = 0
            for q in per_process[rank]:
                send[offset:offset + q.numel].copy_(
                    params[q.param].data.view(-1)[q.start:q.end])
                offset += q.numel
            received = [torch.empty_like(send) for _ in per_process]
            with failures_as_errors("Gathering the updated weight shards"):
                dist.all_gather(received, send, group=self.world.group)
            targets, sources = [], []
            for process, pieces in enumerate(per_process):
                if process == rank:
                    continue
                offset = 0
                for q in pieces:
                    targets.append(params[q.param].data.view(-1)[q.start:q.end])
                    sources.append(received[process][offset:offset + q.numel])
                    offset += q.numel
            if targets:
                foreach_copy_(targets, sources)

    # --- the state dictionary ------------------------------------------------------
    def _split(self, full: dict[torch.Tensor, dict[str, StateValue]]) -> None:
        """Take this process's pieces of a whole state (loaded or gathered)."""
        self.state = defaultdict(dict)
        for i, p in enumerate(self.params):
            entry = full.get(p)
            if not entry:
                continue
            if i in self.replicated:
                self.state[p] = dict(entry)
        for piece, shard in self.pieces.items():
            p = self.params[piece.param]
            entry = full.get(p)
            if not entry:
                continue
            self.state[shard] = {k: _slice(v, p, piece) for k, v in entry.items()}
        for t in [t for t in self.state if self.storage.streams(t)]:
            host: dict[str, StateValue] = {}
            self.storage.store(host, self.state[t])
            self.state[t] = host
        self.storage.wait([p.device for p in self.params])

    def gather_into(self, opt: Any) -> None:
        """Before ``opt.state_dict()``: put the whole state into ``opt.state`` (a
        collective over the processes; nothing to do if ``opt.state`` is already whole
        or no step ran since)."""
        if opt is not self.opt or not self.moved_on or any(opt.state.values()):
            return
        local = {}
        for j, piece in enumerate(self.layout.pieces):
            shard = self.pieces.get(piece)
            if shard is not None and self.state.get(shard):
                local[j] = {k: v.detach().cpu() if isinstance(v, torch.Tensor) else v
                            for k, v in self.state[shard].items()}
        gathered: list[Any] = [local]
        if self.world.distributed:
            gathered = [None] * self.world.size
            with failures_as_errors(f"Gathering the optimizer state ({_GATHER_HINT})"):
                dist.all_gather_object(gathered, local, group=self.world.group)
        states: dict[int, dict[str, StateValue]] = {}
        for part in gathered:
            states.update(part)
        full: dict[torch.Tensor, dict[str, StateValue]] = defaultdict(dict)
        for i in self.layout.replicated:
            p = self.params[i]
            if self.state.get(p):
                full[p] = {k: v.to(p.device) if isinstance(v, torch.Tensor) else v
                           for k, v in self.state[p].items()}
        for i, pieces in self.layout.by_param.items():
            maybe = [states.get(self.piece_index[q]) for q in pieces]
            found = [f for f in maybe if f is not None]
            if len(found) != len(maybe):
                continue
            full[self.params[i]] = _join(found, pieces, self.params[i])
        opt.state = full
        self.moved_on = False

    def local_state_bytes(self) -> int:
        """Bytes of optimizer state this process holds."""
        return state_bytes(self.state)


def _slice(value: StateValue, p: torch.Tensor, piece: Piece) -> StateValue:
    if not isinstance(value, torch.Tensor):
        return value
    if piece.whole or value.dim() == 0 or value.numel() != p.numel():
        return value.detach().to(p.device, copy=True)
    return value.detach().reshape(-1)[piece.start:piece.end].to(p.device, copy=True)


def _join(found: list[dict[str, StateValue]], pieces: list[Piece], p: torch.Tensor
          ) -> dict[str, StateValue]:
    """One parameter's whole state from its pieces' states."""
    entry: dict[str, StateValue] = {}
    for key, first in found[0].items():
        values = [f.get(key) for f in found]
        elementwise = all(isinstance(v, torch.Tensor) and v.dim() >= 1
                          and v.numel() == q.numel for v, q in zip(values, pieces, strict=False))
        if pieces[0].whole or not elementwise:
            entry[key] = first.to(p.device) if isinstance(first, torch.Tensor) else first
            continue
        whole = torch.empty(p.numel(), dtype=first.dtype, device=p.device)
        for v, q in zip(values, pieces, strict=False):
            assert isinstance(v, torch.Tensor)  # (elementwise: every piece holds one)
            whole[q.start:q.end].copy_(v.reshape(-1))
        entry[key] = whole.view(p.shape)
    return entry


