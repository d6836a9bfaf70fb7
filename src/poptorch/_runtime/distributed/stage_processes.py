"""Where the stages of a pipeline live when each runs in a process of its own.

With ``Options.Distributed.stagesOnProcesses()`` process ``p`` runs stage
``p % stages`` of pipeline replica ``p // stages``. A *pipeline group* per replica (its
processes in stage order) carries ``torch.distributed.pipelining``'s sends; a *stage
group* per stage (its process in every replica) sums the stage's gradients. Every
process creates every group (``dist.new_group`` is collective), in the same order.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ...errors import Error
from .collectives import broadcast_, failures_as_errors
from .reducer import GradientReducer
from .world import World, timeout


@dataclass(frozen=True)
class StageLayout:
    """This process's place in a run of stage processes (module docstring)."""

    world: World
    stages: int
    stage: int  # the stage this process runs
    replica: int  # the pipeline replica it belongs to
    # the processes of this replica, stage order (None: the world)
    pipeline_group: dist.ProcessGroup | None
    stage_world: World  # this stage's processes over the replicas (rank: the replica)

    @property
    def replicas(self) -> int:
        return self.world.size // self.stages

    def rank_of(self, replica: int, stage: int) -> int:
        """The global rank running ``stage`` of pipeline ``replica``."""
        return replica * self.stages + stage

    @property
    def last_rank(self) -> int:
        """The global rank of the last stage of this process's pipeline."""
        return self.rank_of(self.replica, self.stages - 1)


def check_world(world: World, stages: int) -> None:
    """The run must have a whole number of pipelines of ``stages`` processes."""
    if stages < 2:
        raise Error(
            "Distributed.stagesOnProcesses: the model has a single pipeline stage, so there "
            "is nothing to place on separate processes. Split it with poptorch.BeginBlock / "
            "Block into stages on different IPUs, or leave stagesOnProcesses off.")
    if world.size % stages != 0:
        raise Error(
            f"Distributed.stagesOnProcesses: the pipeline has {stages} stages but the run "
            f"has {world.size} process(es); the processes must be a multiple of the stages "
            f"(stages x pipeline replicas): start {stages} processes per replica, for "
            f"example torchrun --nproc_per_node={stages} (one replica), or leave "
            "stagesOnProcesses off to run every stage in each process.")


def make_layout(world: World, stages: int) -> StageLayout:
    """The layout of this process; creates the process groups (collective)."""
    check_world(world, stages)
    replicas = world.size // stages
    stage, replica = world.rank % stages, world.rank // stages
    if replicas == 1:
        return StageLayout(world, stages, stage, 0, world.group, World(0, 1, None))
    with failures_as_errors("Creating the pipeline process groups"):
        pipelines = [dist.new_group([r * stages + s for s in range(stages)], timeout=timeout())
                     for r in range(replicas)]
        by_stage = [dist.new_group([r * stages + s for r in range(replicas)], timeout=timeout())
                    for s in range(stages)]
    return StageLayout(world, stages, stage, replica, pipelines[replica],
                       World(replica, replicas, by_stage[stage]))


def start_from_process_0(world: World, tensors: Sequence[torch.Tensor]) -> None:
    """Give every process process 0's weights and buffers (all stages), so the stages
    of every replica start from one model whichever process built which."""
    broadcast_([t.data for t in tensors], world.group)


def gather_stages(layout: StageLayout, tensors_of_stage: list[list[torch.Tensor]]) -> None:
    """Every process receives every stage's tensors from replica 0's process of that
    stage (all processes call this together)."""
    for s, tensors in enumerate(tensors_of_stage):
        broadcast_([t.data for t in tensors], layout.world.group, src=layout.rank_of(0, s))


class StageReplicaGroup:
    """The cross-process side of a training model whose stages run on processes, as the
    device program sees it (the interface of ``replicas.DataParallelGroup``): the
    gradients of this process's stage are summed over its replicas (the stage group);
    ``world`` is that group, so the program's Mean divides by the replicas' micro-batches."""

    def __init__(self, layout: StageLayout, params: list[torch.nn.Parameter],
                 buffers: list[torch.Tensor], broadcast_buffers: bool) -> None:
        self.world = layout.stage_world
        self.reducer = GradientReducer(self.world, params)
        self.buffers = buffers if broadcast_buffers else []
        self.averaged_over = 1  # the reducer sums
        self.source = layout.rank_of(0, layout.stage)  # global rank of replica 0's

    def attach_sync(self, interpreter: object, compute: object, grouped: bool,
                    device: torch.device) -> None:
        """No reduction inside a backward pass: the stages' schedule decides when each
        backward runs, and the reducer sums after them."""

    def release(self) -> None:
        return None

    def begin_step(self) -> None:
        return None

    def start_identical(self, optimizer: torch.optim.Optimizer | None) -> None:
        """Nothing left to do: the weights came from process 0 at compile time, and the
        optimizer holds state only for this stage's parameters once it steps."""

    def reduce_gradients(self) -> None:
        self.reducer()

    def sync_buffers(self) -> None:
        """Replica 0's buffers of this stage to its other replicas (broadcastBuffers)."""
        if self.buffers:
            broadcast_([b.data for b in self.buffers], self.world.group, src=self.source)
