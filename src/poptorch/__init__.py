"""OpenPopTorch: the PopTorch API on modern PyTorch.

This module only re-exports the public API; each name lives in its own module.
"""
# ruff: noqa: F401
# --- foundation: enums and errors ---------------------------------------------
# --- automatic mixed-precision casting (seed 003) ----------------------------------
# --- optimizers (issue 5) ----------------------------------------------------------
# --- upstream's private modules that libraries import (issue 17) ------------------
from . import (
                    _impl,
                    _poplar_executor,
                    autocasting,
                    enums,
                    ops,
                    optim,
                    options,
                    poptorch_core,
                    profiling,
)
from ._devices import ipuHardwareIsAvailable, ipuHardwareVersion

# --- foundation: options, logging, devices (issue 2) -----------------------------
from ._logging import logger, setLogLevel
from ._runtime.export import importPoptorchMetadataFromFile
from ._version import __version__

# --- annotations and execution strategies (issue 6) -------------------------------
from .annotations import (
                    IPU,
                    BeginBlock,
                    Block,
                    BlockFunction,
                    BlockId,
                    LegacyBeginBlockFn,
                    ParallelPhasedExecution,
                    Phase,
                    PipelinedExecution,
                    SerialPhasedExecution,
                    ShardedExecution,
                    Stage,
                    recomputationCheckpoint,
                    removeBlocks,
)
from .autocasting import autocast

# --- data (issue 4) ---------------------------------------------------------------
from .data import AsynchronousDataAccessor, DataLoader
from .enums import (
                    AnchorMode,
                    AutoStage,
                    CommGroupType,
                    ConnectionType,
                    DataLoaderMode,
                    HalfFloatCastingBehavior,
                    Liveness,
                    MatMulSerializationMode,
                    MeanReductionStrategy,
                    MultiConvPlanType,
                    OutputMode,
                    OverlapMode,
                    ReductionType,
                    SharingStrategy,
                    SyncPattern,
                    VariableRetrievalMode,
)
from .errors import (
                    ConfigFileError,
                    Error,
                    RecoverableError,
                    UnrecoverableError,
                    createPoptorchError,
)

# --- executor (issue 3) -----------------------------------------------------------
from .executor import PoplarExecutor, inferenceModel, isRunningOnIpu, load, trainingModel
from .executor.argparsers import (
                    ICustomArgParser,
                    registerCustomArgParser,
                    registerGeometricCustomArgParsers,
)
from .executor.hooks import poptorchAtExit, registerPostCompileHook, registerPreCompileHook

# --- ops (identity_loss, custom ops, ...) -----------------------------------------
from .ops import (
                    CPU,
                    MultiConv,
                    NameScope,
                    accessAttributes,
                    attributes_lists,
                    cond,
                    ctc_beam_search_decoder,
                    custom_op,
                    dynamic_slice,
                    dynamic_update,
                    for_loop,
                    fps,
                    getIpuTensorId,
                    identity_loss,
                    ipu_print_tensor,
                    nearest,
                    nop,
                    serializedMatMul,
                    set_available_memory,
                    set_overlap_for_input,
                    set_overlap_for_output,
)
from .ops.module_repr import module_repr, print
from .options import Attribute, Options, TensorLocationSettings
