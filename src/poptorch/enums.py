"""Enumerations of the PopTorch API, with upstream's member values.

Member values matter: programs and config files pass them as integers or strings,
and ``Options.toDict()`` shows them.
"""
import enum

__all__ = [
    "AnchorMode",
    "AutoStage",
    "CommGroupType",
    "ConnectionType",
    "DataLoaderMode",
    "HalfFloatCastingBehavior",
    "Liveness",
    "MatMulSerializationMode",
    "MeanReductionStrategy",
    "MultiConvPlanType",
    "OutputMode",
    "OverlapMode",
    "ReductionType",
    "SharingStrategy",
    "SyncPattern",
    "VariableRetrievalMode"
]


class MeanReductionStrategy(enum.IntEnum):
    """When the mean over accumulated / replicated gradients is divided out.

    ``Running`` keeps a running mean, ``Post`` divides once after summing, and
    ``PostAndLoss`` divides the loss as well. All three give the mathematical mean;
    they differ only in rounding.
    """
    Running = 0
    Post = 1
    PostAndLoss = 2


class DataLoaderMode(enum.IntEnum):
    """How :py:class:`poptorch.DataLoader` reads its data set."""
    Sync = 0
    Async = 1
    AsyncRebatched = 2


class SharingStrategy(enum.IntEnum):
    """How an asynchronous loader's worker shares tensors with the main process."""
    SharedMemory = 0
    FileSystem = 1
    Fork = 2
    ForkServer = 3


class OutputMode(enum.IntEnum):
    """Which outputs of one call of a model come back to the host."""
    Final = 0
    EveryN = 1
    All = 2
    Sum = 3
    Default = 4


# SDK 2.x name of OutputMode; programs written for it still run.
AnchorMode = OutputMode


class ConnectionType(enum.IntEnum):
    """When to attach to the device (recorded only: our devices are always there)."""
    Always = 0
    OnDemand = 1
    Never = 2


class HalfFloatCastingBehavior(enum.IntEnum):
    """How operations mixing float16 and float32 inputs are computed."""
    FloatDowncastToHalf = 0
    HalfUpcastToFloat = 1
    Default = 2


class ReductionType(enum.IntEnum):
    """How gradients (or losses) of several micro-batches are combined."""
    Sum = 0
    Mean = 1
    NoReduction = 2


class SyncPattern(enum.IntEnum):
    """IPU synchronisation pattern (recorded only: no meaning on our devices)."""
    Full = 0
    SinglePipeline = 1
    ReplicaAndLadder = 2


class MatMulSerializationMode(enum.Enum):
    """Which dimension :py:func:`poptorch.serializedMatMul` splits."""
    InputChannels = "input_channels"
    ReducingDim = "reducing_dim"
    OutputChannels = "output_channels"
    Disabled = "none"


class Liveness(enum.IntEnum):
    """Where tensors of inactive phases live in phased execution."""
    AlwaysLive = 0
    OffChipAfterFwd = 1
    OffChipAfterFwdNoOverlap = 2
    OffChipAfterEachPhase = 3


class OverlapMode(enum.Enum):
    """Overlap of host IO with compute for an input or output tensor."""
    NoOverlap = "no_overlap"
    OverlapAccumulationLoop = "overlap_accumulation_loop"
    OverlapDeviceIterationLoop = "overlap_device_iteration_loop"


class AutoStage(enum.IntEnum):
    """How blocks without an explicit stage are given one."""
    SameAsIpu = 0
    AutoIncrement = 1


class MultiConvPlanType(enum.IntEnum):
    """Planning of a :py:class:`poptorch.MultiConv` group."""
    Parallel = 0
    Serial = 1


class CommGroupType(enum.IntEnum):
    """How replicas are grouped for a collective or a variable's settings."""
    All = 0
    Consecutive = 1
    Orthogonal = 2
    NoGrouping = 3


class VariableRetrievalMode(enum.IntEnum):
    """Which replicas' copies of a grouped variable come back to the host."""
    OnePerGroup = 0
    AllReplicas = 2
