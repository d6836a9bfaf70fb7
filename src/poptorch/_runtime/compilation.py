"""What one compile of a PopTorch model produced, as one typed object.

``PoplarExecutor._compile`` builds a :py:class:`Compilation` once, from the pieces it
made (the options as compiled, the device program, the weight sync, the input signature,
the program's source, the devices, the optimizer binding, precision and casting), and
holds it as ``executor._compiled``; ``destroy()`` drops it in one assignment and a later
call compiles a new one. Every module that needs one of those pieces (the per-call fast
path, saving and exporting, inspection) is handed the ``Compilation`` or the piece
itself, never the executor's attributes.

What the compile produced never changes afterwards (the dataclass is frozen). What
changes later lives in two small mutable parts, so that their writers are easy to find:
``program.optimizer.OptimizerBinding`` (``setOptimizer`` binds another optimizer) and
:py:class:`CallState` (attachment, the first calls' checks and counts, the fast-path
decision).
"""
from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, TypedDict

import torch

if TYPE_CHECKING:  # (types only: importing them here would load the whole engine)
    from typing_extensions import Unpack

    from .._typing import UserOutput
    from .batching.anchors import AnchorRecorder
    from .batching.signature import InputSignature
    from .batching.synthetic import SyntheticInputs
    from .config import RuntimeConfig
    from .executable.source import ProgramSource
    from .numerics.autocast import AutocastRun
    from .numerics.precision import PrecisionPolicy
    from .program.concurrent_replicas import ReplicaCopies
    from .program.device_loop import DeviceProgram
    from .program.optimizer import OptimizerBinding
    from .program.runner import ReplicaBuffers
    from .weights.constants import TensorConstants
    from .weights.sync import WeightSync

__all__ = ["CallState", "Compilation"]


class WeightsCopied(TypedDict, total=False):
    """Which host values :py:meth:`Compilation.weights_to_device` copies
    (``WeightSync.to_device``)."""
    params: bool
    buffers: bool
    buffer_names: Collection[str] | None


@dataclass(eq=False)
class CallState:
    """What the calls of one compiled program change on it."""
    attached: bool = True  # holds its device (detachFromDevice / attachToDevice)
    io_counts: tuple[int, int] = (0, 0)  # tensors in and out of the first call
    # The per-call fast path (executor/program_call.py): None = not decided yet (decided
    # after the next general call), False = never, else the callable.
    fast: Callable[[tuple, dict], UserOutput] | Literal[False] | None = None


@dataclass(frozen=True, eq=False)
class Compilation:
    """Everything one compile of a model produced (see module docstring)."""
    config: RuntimeConfig  # the options as compiled
    device: torch.device  # where inputs go (the first stage's device)
    backend: str  # "eager", "inductor" or "fastest"
    program: DeviceProgram
    weights: WeightSync  # host <-> device copies of weights and buffers
    signature: InputSignature  # the compiled inputs, checked on later calls
    tensor_constants: TensorConstants  # plain tensor attributes compiled as constants
    buffers: list  # the model's buffers (put back when a call fails)
    source: ProgramSource  # precompiled file / executable cache, around the first calls
    precision: PrecisionPolicy
    casting: AutocastRun  # float16 rules and autocast, entered around each call
    optimizer: OptimizerBinding | None  # training only
    # per-replica buffers (or model copies) of local replicas, or None
    replica_buffers: ReplicaBuffers | ReplicaCopies | None = None
    synthetic: SyntheticInputs | None = None  # Options.enableSyntheticData
    anchors: AnchorRecorder | None = None  # Options.anchorTensor
    compile_seconds: float = 0.0
    # handles of the forwards the casting rules wrapped on the model's modules
    autocast_hooks: tuple = ()
    # stages on processes: the collective that brings every stage's weights to every
    # process before they are copied to the host (None otherwise)
    gather_weights: Callable[[], None] | None = None
    calls: CallState = field(default_factory=CallState)

    def weights_to_device(self, **which: Unpack[WeightsCopied]) -> None:
        """Host -> device copy (``WeightSync.to_device``); every local replica then holds
        the host's buffers."""
        self.weights.to_device(**which)
        buffers = self.replica_buffers
        if buffers is not None and which.get("buffers", True):
            buffers.broadcast()

    def release(self) -> None:
        """Undo what the compile changed on the model's modules (the casting rules'
        wrapped forwards); called when the compilation is dropped."""
        for handle in self.autocast_hooks:
            handle.remove()
