"""Splitting a captured graph into stage modules, once, at compile time.

Every node of the captured graph belongs to the stage of its block. :func:`split_stages`
turns the nodes of each stage into a ``torch.fx.GraphModule`` of its own whose inputs
are the values it reads from the model's inputs and from earlier stages, and whose
outputs are the values later stages (or the model's output) read: the stage modules of
``torch.distributed.pipelining``'s ``Pipe``, made from block annotations. The stage
modules share the model's own submodules, parameters and buffers (no copy), so the
optimizer and the weight sync see the same tensors.

The model's output (and the losses marked by ``identity_loss``) is assembled by the
last stage: values of other stages that it needs cross into it like any boundary.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from operator import attrgetter

import torch
import torch.fx

from ..torch_internals import pytree
from .captured import BLOCK_META, CapturedModel
from .partition import Partition
from .recompute import checkpoint_values


@dataclass
class StageModule:
    """One stage: its graph module and where its inputs come from."""
    index: int
    module: torch.fx.GraphModule
    # per input: ("input", placeholder name) or ("stage", producer stage, output position)
    sources: list[tuple] = field(default_factory=list)
    consumers: list[int] = field(default_factory=list)  # later stages reading its outputs
    producers: list[int] = field(default_factory=list)  # earlier stages it reads from
    num_outputs: int = 0
    checkpoints: bool = False  # recomputation checkpoints cut its forward into segments


@dataclass
class StagedModel:
    """The model split into stages, and how the model's output is rebuilt."""
    stages: list[StageModule]
    # the output structure: pytree of ("stage", s, position) / ("const", value) leaves
    output_spec: pytree.TreeSpec
    output_sources: list[tuple]
    loss_sources: list[tuple]


def split_stages(captured: CapturedModel, part: Partition) -> StagedModel:
    """Split ``captured`` into the stages of ``part`` (module docstring)."""
    gm = captured.graph_module
    num = part.num_stages
    stage_of: dict[torch.fx.Node, int] = {}
    for node in gm.graph.nodes:
        block = node.meta.get(BLOCK_META)
        if block is not None:
            stage_of[node] = part.block_stage[block]
    _check_forward_order(gm, stage_of)
    output_node = next(n for n in gm.graph.nodes if n.op == "output")
    last = num - 1
    # values each stage exports: node -> position in its output tuple
    exports: list[dict[torch.fx.Node, int]] = [{} for _ in range(num)]
    imports: list[list[torch.fx.Node]] = [[] for _ in range(num)]

    def need(consumer: int, node: torch.fx.Node) -> None:
        if node.op == "get_attr":
            return
        if node.op == "placeholder" or stage_of[node] != consumer:
            if node not in imports[consumer]:
                imports[consumer].append(node)
            if node.op != "placeholder":
                exports[stage_of[node]].setdefault(node, len(exports[stage_of[node]]))

    for node in gm.graph.nodes:
        if node in stage_of:
            for arg in node.all_input_nodes:
                need(stage_of[node], arg)
    wanted = list(output_node.all_input_nodes) + list(captured.loss_nodes)
    for node in wanted:
        need(last, node)
        if stage_of.get(node) == last:
            exports[last].setdefault(node, len(exports[last]))
    stages = []
    for s in range(num):
        module, sources = _stage_module(gm, s, stage_of, imports[s], exports)
        producers = sorted({src[1] for src in sources if src[0] == "stage"})
        checkpoints = any(n.op == "call_function" and n.target is checkpoint_values
                          for n in module.graph.nodes)
        stages.append(StageModule(s, module, sources, [], producers, len(exports[s]),
                                  checkpoints))
    for stage in stages:
        for p in stage.producers:
            stages[p].consumers.append(stage.index)

    def source(node: torch.fx.Node) -> tuple:
        # the last stage exposes the values it needs for the output as its own inputs
        # (imported) or outputs (made there)
        if node.op == "get_attr":
            return ("const", attrgetter(str(node.target))(gm))  # (get_attr: a name)
        if node.op == "placeholder" or stage_of[node] != last:
            return ("import", imports[last].index(node))
        return ("stage", last, exports[last][node])

    # the last stage also outputs the values the model's output reads from it
    out_leaves, out_spec = pytree.tree_flatten(output_node.args[0])
    output_sources = [source(v) if isinstance(v, torch.fx.Node) else ("const", v)
                      for v in out_leaves]
    loss_sources = [source(n) for n in captured.loss_nodes]
    return StagedModel(stages, out_spec, output_sources, loss_sources)


def _check_forward_order(gm: torch.fx.GraphModule, stage_of: dict[torch.fx.Node, int]) -> None:
    """A stage may read only from earlier stages (checked for pipelines by the block
    rules; sharded stages that revisit an earlier stage cannot be split)."""
    for node, s in stage_of.items():
        for arg in node.all_input_nodes:
            if arg in stage_of and stage_of[arg] > s:
                raise ValueError("a stage reads a value of a later stage")


def _stage_module(gm: torch.fx.GraphModule, s: int, stage_of: dict[torch.fx.Node, int],
                  imports: list[torch.fx.Node], exports: list[dict[torch.fx.Node, int]]
                  ) -> tuple[torch.fx.GraphModule, list[tuple]]:
    """Stage ``s`` as a graph module, and the source of each of its inputs."""
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    sources: list[tuple] = []
    for i, node in enumerate(imports):
        env[node] = graph.placeholder(f"in_{i}_{node.name}")
        if node.op == "placeholder":
            sources.append(("input", node.target))
        else:
            sources.append(("stage", stage_of[node], exports[stage_of[node]][node]))
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            continue
        if stage_of.get(node) != s:
            continue
        for arg in node.all_input_nodes:
            if arg.op == "get_attr" and arg not in env:
                env[arg] = graph.get_attr(arg.target)
        env[node] = graph.node_copy(node, lambda n: env[n])
    ordered = sorted(exports[s], key=exports[s].__getitem__)
    graph.output(tuple(env[n] for n in ordered))
    module = torch.fx.GraphModule(gm, graph, class_name=f"Stage{s}")
    return module, sources
