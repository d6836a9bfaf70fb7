"""PoplarExecutor: the object ``trainingModel`` / ``inferenceModel`` return.

It is the user-facing side of a compiled model and holds little logic itself: batching
and the device loop live in ``_runtime/batching/`` and ``_runtime/program/``, weight
sharing in ``_runtime/weights/``, model parallelism in ``_runtime/placement/``.
"""
from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any, Protocol

import torch

from .._logging import logger
from .._overrides import SUBSTITUTION_TYPES, substitutions
from .._runtime import context
from .._runtime.batching.plan import split_inputs
from .._runtime.batching.signature import detach_inputs
from .._runtime.compilation import Compilation
from .._runtime.program.device_loop import DeviceProgram
from .._runtime.program.optimizer import attach_optimizer, make_loss_scaler
from .._runtime.program.undo import StateUndo
from .._runtime.schedule.timeline import ScheduleRecord
from .._runtime.torch_internals import pytree
from .._runtime.weights.modelcopy import TrainingMode, shallow_copy_module
from .._typing import UserInput, UserOutput
from ..enums import ConnectionType, OutputMode
from ..errors import Error, PoptorchAssertionError
from ..optim.optimizers import SGD
from ..optim.subclassing import warn_if_subclassed
from ..options.options import Options
from . import hooks as _hooks
from . import optimizer_rules
from .call_support import (
    check_buffers,
    check_inference_accumulation,
    count_tensors,
    to_device,
    undone_on_failure,
)
from .compiler import ModelParts, compile_model, optimizer_sync
from .inspection import ExecutorInspection
from .program_call import MISS, ProgramCall, make_fast_call
from .replica_grouping import GroupableParameter

__all__ = ["PoplarExecutor", "isRunningOnIpu"]

_NO_CONTEXT = contextlib.nullcontext()


def isRunningOnIpu() -> bool:
    """True while the model runs inside an executor ("on the IPU"), False otherwise.

    Lets a model take a different code path on the device:
    ``if poptorch.isRunningOnIpu(): ...``.
    """
    return context.is_running_on_ipu()


_EXECUTOR_IDS = itertools.count()


class LoadedKeys(Protocol):
    """What ``torch.nn.Module.load_state_dict`` returns: the keys it did not match."""

    @property
    def missing_keys(self) -> list[str]: ...
    @property
    def unexpected_keys(self) -> list[str]: ...


class PoplarExecutor(ExecutorInspection):
    """A wrapped model that runs whole device programs per call.

    Do not create it directly: use :py:func:`poptorch.trainingModel` or
    :py:func:`poptorch.inferenceModel`.
    """

    def __init__(self, model: torch.nn.Module, options: Options | None, training: bool,
                 poptorch_version: str, optimizer: torch.optim.Optimizer | None = None,
                 user_model: torch.nn.Module | None = None) -> None:
        options = Options() if options is None else options
        if not isinstance(options, Options):
            raise Error(f"options must be a poptorch.Options, not {type(options).__name__}.")
        # As in PopTorch: the user's options are frozen (a later change would not reach
        # this model) and the model works on its own copy, whose Default output mode is
        # resolved (Final for training, All for inference).
        if not training:
            check_inference_accumulation(options)
        options._freeze()
        options = options.clone()
        if options.defaultOutputMode():
            options.outputMode(OutputMode.Final if training else OutputMode.All)
        if not isinstance(model, torch.nn.Module):
            raise Error(f"The model must be a torch.nn.Module, not {type(model).__name__}.")
        if training and optimizer is None:
            optimizer = SGD(model.parameters(), lr=0.01)  # PopTorch's default
        elif training:
            warn_if_subclassed(optimizer)  # (upstream's warning; here step() does run)
        self._init_state(model, options, training, poptorch_version, optimizer,
                         user_model or model)

    def _init_state(self, model: torch.nn.Module, options: Options, training: bool,
                    version: str, optimizer: torch.optim.Optimizer | None,
                    user_model: torch.nn.Module) -> None:
        # Every attribute of the executor's state is created here. The user-facing
        # state lives on the executor; what a compile produces is one Compilation
        # (``_runtime/compilation.py``), held in ``_compiled`` until ``destroy()``.
        self._user_model = user_model
        self._options = options
        self._training = training
        self._poptorch_version = version
        self._optimizer = optimizer
        self._model = shallow_copy_module(model)
        self._model.training = training  # the copy's own flag; submodules: per call
        # A trainingModel of a model in train mode keeps the submodules the user put in
        # eval mode (frozen BatchNorm / Dropout when fine-tuning), as PopTorch does.
        keep_eval = [m for m in user_model.modules() if not m.training] \
            if training and user_model.training else []
        self._mode = TrainingMode(self._model, training, keep_eval)
        self._once_key = next(_EXECUTOR_IDS)  # per-model "log once" messages
        self._compiled: Compilation | None = None
        self._offline = False  # compiled for an offline IPU: it does not run
        self._replica_groupings: dict = {}  # replicaGrouping(), before compiling
        # poptorch.load / loadExecutable: handed to the next compile
        self._pending_precompiled: dict | None = None
        self._pending_rng_state: list | None = None
        # trainingModel: frees the user's module for another training wrapper (destroy)
        self._release_module: Callable[[], None] | None = None

    # ------------------------------------------------------------------ properties
    @property
    def model(self) -> torch.nn.Module:
        """The wrapped torch model (the user's module, with trained weights)."""
        compiled = self._compiled
        if compiled is not None:
            compiled.weights.to_host_if_needed()
        return self._user_model

    @property
    def options(self) -> Options:
        """The options this model was created with."""
        return self._options

    @property
    def rng_state(self) -> list:
        """The seed and generator state of the device program's random stream."""
        program = self._require_compiled("rng_state")
        rng = program.rng
        if not rng.enabled:
            return [None, torch.get_rng_state()]
        assert rng.state is not None  # (an enabled stream has its state)
        return [rng.seed, rng.state.clone()]

    @rng_state.setter
    def rng_state(self, state: list) -> None:
        program = self._require_compiled("rng_state")
        seed, generator_state = state
        program.rng.load(seed, generator_state)

    # ------------------------------------------------------------------ compile
    def _compile(self, args: tuple, kwargs: dict) -> None:
        from tqdm import tqdm
        opts = self._options
        t0 = time.perf_counter()
        _hooks.run_pre_compile_hooks()
        bar = tqdm(total=4, desc="Graph compilation", leave=False, unit="stage",
                   disable=not opts.show_compilation_progress_bar)
        parts = ModelParts(
            model=self._model, user_model=self._user_model, options=opts,
            training=self._training, optimizer=self._optimizer,
            version=self._poptorch_version, groupings=self._replica_groupings,
            name=self._model_name())
        try:
            compiled = compile_model(parts, args, kwargs, self._pending_precompiled, bar)
        finally:
            bar.close()
        self._pending_precompiled = None  # (installed by the program's source)
        self._offline = opts.connection_type == ConnectionType.Never.value
        try:
            opts._freeze()
            opts._apply_effects()  # logging options; logs the options without effect
            from .ipu_environment import log_ipu_only_environment
            log_ipu_only_environment()
        except BaseException:
            compiled.release()
            raise
        seconds = time.perf_counter() - t0
        self._compiled = replace(compiled, compile_seconds=seconds)
        logger.debug("Compiled %s in %.3f s", parts.name, seconds)
        self._apply_pending_rng()
        _hooks.run_post_compile_hooks()

    def _apply_pending_rng(self) -> None:
        state, self._pending_rng_state = self._pending_rng_state, None
        if state is not None and state[0] is not None:
            self.rng_state = state

    def _model_name(self) -> str:
        opts = self._options
        name = opts.model_name if opts.exists("model_name") else type(self._user_model).__name__
        return f"{name}.{'training' if self._training else 'inference'}"

    def compile(self, *args: UserInput, **kwargs: UserInput) -> None:
        """Compile the model for these inputs without running it (no-op if compiled)."""
        if self._compiled is None:
            with substitutions():  # (poptorch_geometric's ops in place of PyG's)
                self._compile(args, kwargs)

    # ------------------------------------------------------------------ run
    def __call__(self, *args: UserInput, **kwargs: UserInput) -> UserOutput:
        compiled = self._compiled
        if compiled is not None and not SUBSTITUTION_TYPES and not self._offline \
                and (not self._training or torch.is_grad_enabled()):
            fast = compiled.calls.fast  # program_call.ProgramCall, settled
            if fast:
                result = fast(args, kwargs)
                if result is not MISS:
                    return result
        if self._offline or (compiled is None and self._options.connection_type
                             == ConnectionType.Never.value):
            # upstream: an assert (so AssertionError)
            raise PoptorchAssertionError(
                "Trying to run a model on an offline device (ConnectionType.Never): use "
                "model.compile(inputs) instead of model(inputs), or create the model "
                "without useOfflineIpuTarget() / connectionType(ConnectionType.Never) to "
                "run it.")
        return self._call_any(args, kwargs)

    def _call_any(self, args: tuple, kwargs: dict) -> UserOutput:
        """A call, whatever the connection type (``compileAndExport`` runs an offline
        model's first calls to compile it)."""
        if SUBSTITUTION_TYPES:  # poptorch_geometric's ops in place of PyG's
            with substitutions():
                return self._call(args, kwargs, fast=True)
        return self._call(args, kwargs)

    def _call(self, args: tuple, kwargs: dict, fast: bool = False) -> UserOutput:
        """A call: the fast path (``fast``: when ``__call__`` did not try it), the first
        call, or checked inputs run under one undo guard; the fast path is decided
        after the first later call."""
        if self._training and not torch.is_grad_enabled():
            return self._call_with_grad(args, kwargs)
        compiled = self._compiled
        settled = None if compiled is None else compiled.calls.fast
        if fast and settled:
            result = settled(args, kwargs)
            if result is not MISS:
                return result
        args, kwargs = detach_inputs(args, kwargs, self._once_key)
        if compiled is None:
            return self._first_call(args, kwargs)
        self._check_signature(compiled, args, kwargs)  # before anything runs
        with undone_on_failure(None):  # (device faults moving the inputs, too)
            result = self._run(compiled, args, kwargs)
        if settled is None:
            compiled.calls.fast = make_fast_call(compiled, self._mode, args, kwargs)
        return result

    def _first_call(self, args: tuple, kwargs: dict) -> UserOutput:
        """Compile, then run: a failure leaves the model, the optimizer (compiling may
        create its state) and the buffers' registration as they were, and nothing
        compiled."""
        model = self._model
        undo = StateUndo(list(model.parameters()) + list(model.buffers()), modules=model,
                         optimizer=self._optimizer if self._training else None)
        with undone_on_failure(undo, cleanup=self._drop_compilation):
            self._compile(args, kwargs)
            compiled = self._compiled
            assert compiled is not None
            result = self._run(compiled, args, kwargs, undo=False)
            check_buffers(undo)  # PopTorch's rule for the compiling call
        compiled.calls.io_counts = (count_tensors((args, kwargs)), count_tensors(result))
        return result

    def _run(self, compiled: Compilation, args: tuple, kwargs: dict, undo: bool = True
             ) -> UserOutput:
        """One call of the compiled program on these (checked) inputs, in the sequence
        every call runs (``program_call.ProgramCall``; ``undo``: take the call's undo
        copies, as every call but the first does)."""
        if not compiled.calls.attached:
            self.attachToDevice()
        if compiled.synthetic is not None:
            args, kwargs = compiled.synthetic(args, kwargs)
        elif compiled.device.type != "cpu":
            args, kwargs = to_device((args, kwargs), compiled.device)
        source = compiled.source
        compiled.casting.observe(args, kwargs)
        with source.first_call() if source.fresh else _NO_CONTEXT:
            result = ProgramCall(compiled, self._mode)(args, kwargs, compiled.program.run,
                                                       undo=undo)
        compiled.weights.mark_device_newer()
        return result

    def _call_with_grad(self, args: tuple, kwargs: dict) -> UserOutput:
        """A training call made under ``torch.no_grad()`` or ``torch.inference_mode()``:
        the device program keeps its own autograd state (on an IPU the host's grad
        mode does not reach the compiled training program), so the call trains as
        anywhere else. Inference tensors become ordinary tensors first (autograd
        cannot save them for the backward pass)."""
        with torch.inference_mode(False), torch.enable_grad():
            args, kwargs = pytree.tree_map_only(
                torch.Tensor, lambda t: t.clone() if t.is_inference() else t, (args, kwargs))
            return self(*args, **kwargs)

    def _check_signature(self, compiled: Compilation, args: tuple, kwargs: dict) -> None:
        try:
            compiled.signature.check(args, kwargs)
        except Error:
            # A batch that does not divide into micro-batches has the clearer message.
            split_inputs(compiled.program.plan, args, kwargs)
            raise

    # ------------------------------------------------------------------ weights
    def copyWeightsToHost(self) -> None:
        """Copy the device weights (and buffers) to the user's model."""
        if self._loaded_not_run():
            return
        compiled = self._require_compilation("copyWeightsToHost")
        if compiled.gather_weights is not None:  # stages on processes: a collective
            compiled.gather_weights()
        compiled.weights.to_host()

    def _loaded_not_run(self) -> bool:
        """A model from ``poptorch.load`` compiles at its first call; until then its
        weights live only in the host model, so weight copies have nothing to do."""
        return self._compiled is None and self._pending_precompiled is not None

    def copyWeightsToHostIfNeeded(self) -> bool:
        """Copy the weights to the host if the device has newer ones; True if copied."""
        compiled = self._compiled
        return compiled is not None and compiled.weights.to_host_if_needed()

    def copyWeightsToDevice(self) -> None:
        """Copy the user's model weights (and buffers) to the device."""
        if self._loaded_not_run():
            return
        self._require_compilation("copyWeightsToDevice").weights_to_device()

    def copyNamedBuffersToDevice(self) -> None:
        """Copy the user's model buffers named by ``Options.updatableNamedBuffers`` (only
        those) to the device; without that option it raises, as upstream."""
        compiled = self._require_compilation("copyNamedBuffersToDevice")
        names = self._options.updatable_named_buffers
        if names is None:
            raise Error("copyNamedBuffersToDevice: No named buffers marked as updatable via "
                        "updatableNamedBuffers option. Name the buffers to copy with "
                        "options.updatableNamedBuffers([...]), or copy all weights and "
                        "buffers with copyWeightsToDevice().")
        compiled.weights_to_device(params=False, buffers=True, buffer_names=set(names))

    def load_state_dict(self, state_dict: dict, strict: bool = True) -> LoadedKeys:
        """Load a state dict into the wrapped model and synchronise the device; returns
        what ``torch.nn.Module.load_state_dict`` returns (the missing and unexpected
        keys)."""
        result = self.model.load_state_dict(state_dict, strict)
        if self._compiled is not None:
            self._compiled.weights_to_device()
        return result

    # ------------------------------------------------------------------ optimizer
    def setOptimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Use ``optimizer``'s hyperparameters from the next call on (no recompilation).

        The optimizer state on the device (momentum, ...) is kept unless ``optimizer``
        carries state of its own.
        """
        if not self._training:
            raise PoptorchAssertionError("setOptimizer: this is an inference model; only a "
                                         "trainingModel has an optimizer.")
        warn_if_subclassed(optimizer)
        compiled = self._compiled
        if compiled is not None:
            from ..optim.attributes import OptimizerSnapshot, check_update
            binding = compiled.optimizer
            # (a compiled training model has one, and its compile's constants)
            assert binding is not None and isinstance(binding.constants, OptimizerSnapshot)
            constants = binding.constants
            options = self._options
            optimizer_rules.apply_mean_reduction_rule(options, optimizer, True)
            optimizer_rules.warn_unexpected_attributes(
                binding.keys, optimizer, options.relax_optimizer_attributes_checks)
            try:
                check_update(constants, optimizer,
                             options.relax_optimizer_attributes_checks)
            except Error:
                if optimizer is self._optimizer or optimizer is binding.device:
                    # the refused change was made in the optimizer in force: undo it,
                    # so that the compiled value stays in force (as on an IPU)
                    from ..optim.attributes import restore_constants
                    restore_constants(constants, optimizer)
                raise
            attached = attach_optimizer(optimizer, self._model, self._user_model,
                                        compiled.weights, previous=binding.device)
            compiled.precision.prepare_optimizer(attached)
            binding.bind(attached, optimizer_sync(optimizer, attached),
                         make_loss_scaler(optimizer, compiled.config, binding.scaler))
            compiled.calls.fast = None  # built again with this sync
            optimizer_rules.mark_compiled(optimizer, options)
        self._optimizer = optimizer

    @property
    def _executable(self) -> DeviceProgram | None:
        """The compiled program, None before compilation and after ``destroy()`` (the
        attribute libraries such as lightning-graphcore test, as upstream's)."""
        return None if self._compiled is None else self._compiled.program

    # the compiled program, as tests and benchmarks read it (docs/design.md)
    _program = _executable

    @property
    def schedule(self) -> ScheduleRecord | None:
        """The schedule the last step of a model-parallel strategy ran (read-only; our
        addition): its planned action lists and what executed, a text timeline when
        printed (docs/parallel.md). None before the first step or without a strategy."""
        return self._options._execution_strategy.last_schedule

    @property
    def backendInUse(self) -> str | None:
        """The backend this model's calls run (our addition): ``"eager"`` or
        ``"compiled"``; ``"compiling"`` or ``"trial"`` during the first calls of the
        automatic backend; None before it is compiled (docs/options.md)."""
        compiled = self._compiled
        return None if compiled is None else compiled.program.backend

    def isCompiled(self) -> bool:
        """True once the model is compiled (and not destroyed)."""
        return self._compiled is not None

    def isAttachedToDevice(self) -> bool:
        """True while the model holds its device."""
        return self._compiled is not None and self._compiled.calls.attached

    def detachFromDevice(self) -> None:
        """Release the device: weights are copied to the host first."""
        compiled = self._require_compilation("detachFromDevice")
        if not compiled.calls.attached:
            raise Error("detachFromDevice: the model is not attached to a device.")
        compiled.weights.to_host_if_needed()
        compiled.calls.attached = False
        compiled.calls.fast = None  # (the fast path assumes an attached model)

    def attachToDevice(self) -> None:
        """Attach to the device again; the host weights are copied to the device."""
        compiled = self._require_compilation("attachToDevice")
        if self._offline:
            raise PoptorchAssertionError(
                "Trying to attach to an offline device (ConnectionType.Never): a model "
                "compiled for an offline IPU target cannot run; save it "
                "(compileAndExport) and run it with poptorch.load.")
        if compiled.calls.attached:
            raise Error("attachToDevice: the model is already attached to a device.")
        compiled.weights_to_device()
        compiled.calls.attached = True
        logger.debug("Attached to %s", compiled.device)

    def destroy(self) -> None:
        """Release the device and the compiled program; the next call compiles again.
        A training model also releases its module, which may then be wrapped again."""
        self._drop_compilation()
        release, self._release_module = self._release_module, None
        if release is not None:
            release()

    def _release_module_on_destroy(self, release: Callable[[], None]) -> None:
        """``trainingModel``: ``release()`` at ``destroy()`` frees the user's module."""
        self._release_module = release

    def _drop_compilation(self) -> None:
        compiled, self._compiled = self._compiled, None
        if compiled is not None:
            compiled.weights.to_host_if_needed()
            compiled.release()
        self._mode.forget()

    def _require_compilation(self, what: str) -> Compilation:
        compiled = self._compiled
        if compiled is None:
            raise Error(f"{what}: Model has not been compiled or has been destroyed. "
                        "Call it (or compile(*inputs)) first.")
        return compiled

    def _require_compiled(self, what: str) -> DeviceProgram:
        return self._require_compilation(what).program

    def save(self, filename: str, export_model: bool = True,
             save_rng_state: bool = True) -> None:
        """Save the compiled model (and, with export_model, the torch model) to a file."""
        from .._runtime.export import save_compiled
        compiled = self._require_compilation("save")
        self.copyWeightsToHostIfNeeded()
        save_compiled(filename, compiled, user_model=self._user_model,
                      options=self._options, training=self._training,
                      optimizer=self._optimizer, version=self._poptorch_version,
                      rng_state=self.rng_state if save_rng_state else None,
                      export_model=export_model)

    def compileAndExport(self, filename: str, *args: UserInput, export_model: bool = True,
                         **kwargs: UserInput) -> None:
        """Compile for these inputs and save the result (with the compiled program and
        the input signature, see docs/precompilation.md) to ``filename``; the model's
        state is left as it was."""
        from .._runtime.export import compile_by_running
        self.compile(*args, **kwargs)
        compiled = self._require_compilation("compileAndExport")
        compile_by_running(compiled, self._model, lambda: self._call_any(args, kwargs))
        self.save(filename, export_model=export_model)

    def loadExecutable(self, filename: str) -> None:
        """Restore a model saved with ``compileAndExport`` / ``save`` into this one."""
        from .._runtime.export import check_kind, read_payload
        payload = read_payload(filename)
        check_kind(payload, self._training, filename)
        self.load_state_dict(payload["state_dict"])
        if self._training and payload["optimizer_state"] is not None:
            assert self._optimizer is not None  # (a training model always has one)
            self._optimizer.load_state_dict(payload["optimizer_state"])
        self._restore_from(payload)

    def _restore_from(self, payload: dict) -> None:
        """The random state and the compiled program of a saved model (``poptorch.load``,
        :py:meth:`loadExecutable`): the program and the inputs it was compiled for are
        installed by the next compile; a compiled model keeps its program, and checks
        later calls against the saved inputs."""
        from .._runtime.export import precompiled_of
        self._pending_rng_state = payload["rng_state"]
        self._pending_precompiled = precompiled_of(payload)
        compiled = self._compiled
        if compiled is not None:
            compiled.source.expected = payload.get("signature")
            self._apply_pending_rng()

    def train(self, mode: bool = True) -> PoplarExecutor:
        """A wrapper keeps the mode it was created in: trainingModel trains and
        inferenceModel evaluates. Returns self when the mode matches."""
        if mode != self._training:
            kind = "trainingModel" if self._training else "inferenceModel"
            other = "poptorch.inferenceModel(model)" if self._training else \
                "poptorch.trainingModel(model, options, optimizer)"
            raise Error(f"This is a {kind}: it cannot switch to "
                        f"{'training' if mode else 'evaluation'} mode. Wrap the same module "
                        f"with {other} instead; the two stay in sync.")
        return self

    def eval(self) -> PoplarExecutor:
        """See :py:meth:`train`."""
        return self.train(False)

    def __getattr__(self, name: str) -> Any:
        """The forwarding rule, as in PopTorch: an attribute the executor does not have
        is read from the user's model, private names included (``pop.fc1.weight``, the
        model's own methods, ``pop._modules`` / ``pop.named_modules()`` for a summary
        tool). Python calls this only for names normal lookup did not find, and every
        attribute of the executor's own state is created in ``_init_state``: a misspelt
        one (``self._compield``) is not on the model either and raises an
        ``AttributeError`` naming both objects.

        Not forwarded: anything while the executor is being built or unpickled (its
        state is not there yet: no recursion), ``__dunder__`` names, which ``copy`` /
        ``pickle`` probe on the instance (``__deepcopy__``, ``__setstate__``): copying
        the executor must not copy the model instead, and the executor's own
        properties (an ``AttributeError`` raised inside one propagates as it is).
        """
        if "_user_model" not in self.__dict__ or (
                name.startswith("__") and name.endswith("__")):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute "
                                 f"{name!r}")
        if hasattr(type(self), name):
            # one of our properties raised AttributeError inside: let that error show
            # (reading it again outside this fallback) instead of reading the model
            return object.__getattribute__(self, name)
        model = self.model
        try:
            value = getattr(model, name)
        except AttributeError as exc:
            raise AttributeError(
                f"{type(self).__name__!r} object has no attribute {name!r}, and neither "
                f"has the model it wraps ({type(model).__name__!r} object)") from exc
        if isinstance(value, torch.nn.Parameter):
            return GroupableParameter(self, self._replica_groupings, name, value)
        return value

    def __repr__(self) -> str:
        """The wrapped model as :py:func:`poptorch.module_repr` shows it (with its
        BeginBlock annotations), as in PopTorch."""
        from ..ops.module_repr import module_repr
        return module_repr(self.model)
