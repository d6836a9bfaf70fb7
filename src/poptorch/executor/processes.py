"""A compiled model in a run of several processes (torchrun / ``Options.Distributed``).

Joins the process group, checks that every process compiles the same program (the
options that shape it and the model's tensors), and makes every process start from
process 0's weights and optimizer state. The engine side is
``poptorch._runtime.distributed``.
"""
from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

import torch

from .._logging import logger
from .._runtime.config import RuntimeConfig
from .._runtime.distributed import world as distributed_world
from .._runtime.distributed.consistency import check_same_everywhere
from .._runtime.distributed.replicas import DataParallelGroup
from .._runtime.distributed.stage_processes import StageReplicaGroup
from .._runtime.memory.fsdp import ShardedModel, WeightPlacement
from ..errors import Error

if TYPE_CHECKING:  # (imported where stages run on processes: torch's pipelining)
    from .._runtime.placement.processes import StageProcessRunner


def join_processes(config: RuntimeConfig, model: torch.nn.Module, training: bool,
                   optimizer: torch.optim.Optimizer | None, name: str,
                   device: torch.device, stage_processes: StageProcessRunner | None = None
                   ) -> DataParallelGroup | StageReplicaGroup | None:
    """The cross-process side of a compiled model; None in a single process.
    ``config`` holds the options as compiled; stages on processes have their own
    reduction across processes (``stage_processes``)."""
    processes = config.distributed
    world = distributed_world.join(processes.process_id, processes.num_processes, device)
    if not world.distributed:
        return None
    check_same_everywhere(world, program_signature(config, model, training))
    if stage_processes is not None:  # stages on processes: their own reduction
        return stage_processes.cross_processes(processes.broadcast_buffers)
    params = [p for p in model.parameters() if p.requires_grad]
    cross = DataParallelGroup(world, model, params, processes.broadcast_buffers)
    cross.start_identical(optimizer)
    r = config.replication_factor
    placement = WeightPlacement.of(config.locations.weight, config.locations.accumulator)
    if training and placement.sharded:
        _check_shardable(config)
        if config.distributed.strategy_name is None:
            cross.shard_weights(ShardedModel(model, world, placement, device,
                                             config.training.gradient_accumulation),
                                optimizer)
        else:  # a strategy's stages: sharded between steps (memory.step_shards)
            cross.step_placement = placement
    logger.info("%s: process %d of %d, %d replica(s) per process, %d in all.", name,
                world.rank, world.size, r, r * world.size)
    return cross


def _check_shardable(config: RuntimeConfig) -> None:
    """Sharded weights / accumulators across processes run one replica per process
    (``poptorch.Error`` otherwise, before anything is sharded)."""
    if config.replication_factor != 1:
        raise Error(
            "TensorLocations: replicated tensor sharding of weights / accumulators "
            "across processes runs one replica per process; this program has "
            f"replicationFactor({config.replication_factor}) per process. Shard the "
            "optimizer state only (setOptimizerLocation), or run one replica per process.")


def program_signature(config: RuntimeConfig, model: torch.nn.Module,
                      training: bool) -> dict:
    """What must be the same on every process, by the option names users know."""
    processes, train = config.distributed, config.training
    tensors = [(n, tuple(t.shape), str(t.dtype)) for n, t in
               list(model.named_parameters()) + list(model.named_buffers())]
    digest = hashlib.sha1(repr(tensors).encode()).hexdigest()[:12]
    return {
        "training": training,
        "replicationFactor": config.replication_factor,
        "deviceIterations": config.device_iterations,
        "Training.gradientAccumulation": train.gradient_accumulation,
        "Training.accumulationAndReplicationReductionType": str(train.reduction),
        "Training.meanAccumulationAndReplicationReductionStrategy":
            str(train.mean_strategy),
        "setExecutionStrategy": processes.strategy_name,
        "broadcastBuffers": processes.broadcast_buffers,
        "inputReplicaGrouping": (processes.input_group_size, str(processes.input_cgt)),
        "outputMode": config.output_mode,
        "model parameters and buffers": f"{len(tensors)} tensors, digest {digest}",
    }
