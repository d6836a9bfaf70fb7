"""A stage's backward in two halves: the gradients of its inputs first, its weights' later.

An earlier stage waits for the gradients of the values it handed on; nobody needs a
stage's weight gradients until the optimizer step. So a stage can hand its input
gradients over first (the *input half*) and compute its weight gradients later (the
*weight half*): the zero-bubble schedules' split (``backward_one_chunk(full_backward=
False)`` / ``backward_weight_one_chunk`` in ``torch.distributed.pipelining``), done
with public autograd machinery only:

* a *join* is a node of the input path (between the stage's inputs and its roots) into
  which a weight's path flows (``Linear``: its ``AddmmBackward``). A pre-hook on every
  join keeps the gradient it receives during the input half,
  ``torch.autograd.grad(roots, inputs)``, which computes no weight gradient;
* the weight half runs ``torch.autograd.backward`` from the joins (``GradientEdge``)
  with the kept gradients down to the weights (``inputs=``), one call per group of
  weights sharing joins; the weights' accumulators run as in a full backward (same
  kernels, hooks and order of micro-batches).

:func:`plan` returns None where a split cannot be exact (a weight whose path never
meets the input path, weights with accumulation hooks, no input needing a gradient):
the engine then runs the full backward.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch.autograd.graph import GradientEdge, Node


def _grad_node(t: torch.Tensor) -> Node | None:
    """The node a gradient for ``t`` flows into (its accumulator for a leaf)."""
    if t.grad_fn is not None:
        return t.grad_fn
    if not t.requires_grad:
        return None
    view = t.view_as(t).grad_fn
    return None if view is None else view.next_functions[0][0]  # the leaf's accumulator


class SplitBackward:
    """The two halves of one stage backward (module docstring)."""

    __slots__ = ("groups", "handles", "kept")

    def __init__(self, groups: list[tuple[list[Node], list[torch.Tensor]]]):
        # per group: its joins and its weights
        self.groups = groups
        self.kept: dict[Node, tuple] = {}
        self.handles: list = []

    def input_half(self, roots: list[torch.Tensor], grads: list[torch.Tensor | None],
                   inputs: list[torch.Tensor]) -> None:
        """Gradients of ``inputs`` (into their ``.grad``); the joins' gradients kept."""
        kept = self.kept
        for joins, _ in self.groups:
            for node in joins:
                if node not in kept:
                    kept[node] = ()
                    self.handles.append(node.register_prehook(_keeper(kept, node)))
        try:
            found = torch.autograd.grad(roots, inputs, grads, retain_graph=True,
                                        allow_unused=True)
        finally:
            for handle in self.handles:
                handle.remove()
            self.handles = []
        for t, g in zip(inputs, found, strict=True):
            if g is not None:
                t.grad = g if t.grad is None else t.grad + g

    def weight_half(self) -> None:
        """Gradients of the weights, accumulated into their ``.grad``."""
        kept = self.kept
        for joins, weights in self.groups:
            edges, values = [], []
            for node in joins:
                for i, g in enumerate(kept.get(node, ())):
                    if g is not None:
                        edges.append(GradientEdge(node, i))
                        values.append(g)
            if not edges:
                continue
            # the weights' accumulators run: .grad and its hooks as in a full backward
            torch.autograd.backward(edges, values, inputs=weights)
        self.kept = {}
        self.groups = []


def _keeper(kept: dict, node: Node) -> Callable[[tuple], None]:
    def hook(grads: tuple) -> None:
        kept[node] = grads
    return hook


def plan(roots: list[torch.Tensor], inputs: list[torch.Tensor],
         weights: Sequence[torch.Tensor]) -> SplitBackward | None:
    """How to split the backward from ``roots`` of a stage with boundary ``inputs`` and
    ``weights`` (its parameters); None when the split would not be exact."""
    if not inputs:
        return None
    # reverse edges of the graph reachable from the roots: node -> the nodes feeding it
    users: dict[Node, list[Node]] = {}
    stack = [n for n in (r.grad_fn for r in roots) if n is not None]
    root_nodes = set(stack)
    seen = set(stack)
    while stack:
        node = stack.pop()
        for nxt, _ in node.next_functions:
            if nxt is None:
                continue
            users.setdefault(nxt, []).append(node)
            if nxt not in seen:
                seen.add(nxt)
                stack.append(nxt)
    # the input path: every node from an input towards the roots
    on_path: set[Node] = set()
    stack = [n for n in map(_grad_node, inputs) if n is not None and n in seen]
    while stack:
        node = stack.pop()
        if node in on_path:
            continue
        on_path.add(node)
        stack.extend(users.get(node, ()))
    if not on_path:
        return None
    # every leaf the full backward would reach must be a weight or an input here
    known = {_grad_node(t) for t in inputs} | {_grad_node(w) for w in weights}
    if any(hasattr(n, "variable") and n not in known for n in seen):
        return None
    # each reachable weight's joins: where its path first meets the input path
    group_of: dict[Node, int] = {}
    groups: list[tuple[list[Node], list[torch.Tensor]]] = []
    for w in weights:
        if not w.requires_grad:
            continue
        acc = _grad_node(w)
        if acc not in seen:
            continue  # does not reach the roots: no gradient in a full backward either
        joins: list[Node] = []
        stack, visited = [acc], {acc}
        while stack:
            node = stack.pop()
            for user in users.get(node, ()):
                if user in visited:
                    continue
                visited.add(user)
                if user in on_path:
                    joins.append(user)
                elif user in root_nodes:
                    return None  # a root fed by weights alone, off the input path
                else:
                    stack.append(user)
        if not joins:
            return None  # a weight's gradient not passing through the input path
        # the groups sharing a join with this weight merge into the first (or a new one)
        merged = sorted({group_of[j] for j in joins if j in group_of}) or [len(groups)]
        if merged[0] == len(groups):
            groups.append(([], []))
        keep, (kept_joins, kept_weights) = merged[0], groups[merged[0]]
        kept_weights.append(w)
        for j in joins + [j for other in merged[1:] for j in groups[other][0]]:
            if j not in kept_joins:
                kept_joins.append(j)
            group_of[j] = keep
        for other in merged[1:]:
            kept_weights.extend(groups[other][1])
            groups[other] = ([], [])
    groups = [g for g in groups if g[1]]
    for joins, _ in groups:
        if len(joins) > 1 and _joins_chained(joins, on_path):
            return None
    return SplitBackward(groups)


def _joins_chained(joins: list[Node], on_path: set[Node]) -> bool:
    """Whether a join reaches another join of its group along the input path (a
    weight used again downstream of its first use): its weight half would recompute
    the input path between them."""
    targets = set(joins)
    for start in joins:
        stack, seen = [start], {start}
        while stack:
            node = stack.pop()
            for nxt, _ in node.next_functions:
                if nxt is None or nxt in seen or nxt not in on_path:
                    continue
                if nxt in targets:
                    return True
                seen.add(nxt)
                stack.append(nxt)
    return False
