"""What a device program is built from: :py:class:`ProgramSpec`, frozen.

``executor/compiler.py`` works out every piece once, at compile time (the runner with
its replicas, processes and profiling around it, the extras the options ask for, the
backends), and the device program is built from this spec in one go: nothing outside
``device_loop.py`` assigns to a program afterwards.
"""
from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch

from ..._typing import UserOutput
from ...enums import OutputMode
from ..batching.plan import BatchPlan
from ..config import TrainingConfig
from ..context import ContextFactory
from ..tracing import CallProfiler, StepTrace
from .rng import RngScope
from .runner import StepRunner
from .step import CrossProcess

__all__ = ["ProgramSpec"]


@dataclass(frozen=True, eq=False)
class ProgramSpec:
    """Everything a ``DeviceProgram`` needs, fixed at compile time."""
    label: str  # the model's name in messages ("<model>.training")
    plan: BatchPlan
    runner: StepRunner  # the eager backend's runner (interpreter, engine, processes)
    # the runner is the one-stage interpreter over the model itself, one micro-batch at
    # a time with nothing per replica: the compiled backend and CUDA graphs may run
    # the calls instead
    plain: bool
    training: bool
    output_mode: OutputMode
    output_return_period: int
    params: tuple[torch.nn.Parameter, ...]  # the trainable parameters
    buffers: tuple[torch.Tensor, ...]  # the model's buffers
    training_config: TrainingConfig
    rng: RngScope
    device: torch.device  # where inputs go
    to_host: Callable[[UserOutput], UserOutput] | None = None  # outputs to the CPU (accelerators)
    anchors: Callable[[int], None] | None = None  # records anchored tensors after a step
    cross: CrossProcess | None = None  # several processes (``step.CrossProcess``)
    # context managers entered around the device loop of every call (precision,
    # strided group norm, profiling), and thread-local context factories for runners
    # with worker threads
    wrappers: tuple[AbstractContextManager[object], ...] = ()
    thread_contexts: tuple[ContextFactory, ...] = ()
    # the floating-point exception check run after every step (outputs, named params)
    finite_check: Callable[[UserOutput, list[tuple[str, torch.nn.Parameter]]], None] | None = None
    named_params: tuple[tuple[str, torch.nn.Parameter], ...] = ()
    call_profiler: CallProfiler | None = None  # a range around the whole call
    trace: StepTrace | None = None  # ... and around each runner call (profiling)
    synthetic: bool = False  # Options.enableSyntheticData: no host <-> device transfers
