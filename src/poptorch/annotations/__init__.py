"""Model-parallel annotations: where the model is split (blocks) and how the pieces run
(stages, phases and the execution strategies).

``blocks``: ``BeginBlock``, ``Block``, ``BlockFunction``, ``LegacyBeginBlockFn``, ``IPU``,
``removeBlocks``, ``recomputationCheckpoint``. ``strategies``: ``Stage``, ``Phase``,
``PipelinedExecution``, ``ShardedExecution``, ``SerialPhasedExecution``,
``ParallelPhasedExecution`` (configuration only; ``poptorch._runtime.placement`` runs
them).
"""
# ruff: noqa: F401
from .blocks import (
                     IPU,
                     BeginBlock,
                     Block,
                     BlockFunction,
                     LegacyBeginBlockFn,
                     begin_block_of,
                     recomputationCheckpoint,
                     removeBlocks,
)
from .strategies import (
                     BlockId,
                     ParallelPhasedExecution,
                     Phase,
                     PipelinedExecution,
                     SerialPhasedExecution,
                     ShardedExecution,
                     Stage,
                     _IExecutionStrategy,
                     _IPhasedExecution,
)

__all__ = [
                     "IPU",
                     "BeginBlock",
                     "Block",
                     "BlockFunction",
                     "BlockId",
                     "LegacyBeginBlockFn",
                     "ParallelPhasedExecution",
                     "Phase",
                     "PipelinedExecution",
                     "SerialPhasedExecution",
                     "ShardedExecution",
                     "Stage",
                     "recomputationCheckpoint",
                     "removeBlocks",
]
