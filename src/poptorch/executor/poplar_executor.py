"""PoplarExecutor: the object ``trainingModel`` / ``inferenceModel`` return.

It is the user-facing side of a compiled model and holds little logic itself: batching
and the device loop live in ``_runtime/batching/`` and ``_runtime/program/``, weight
sharing in ``_runtime/weights/``, model parallelism in ``_runtime/placement/``.
"""
from __future__ import annotations

import contextlib
import itertools
import time
from typing import Any

import torch
from .._runtime.torch_internals import pytree

from .. import _devices
from . import hooks as _hooks, optimizer_rules, program_setup
from .fast_call import MISS, make_fast_call
from .local_replicas import local_replica_runner
from .processes import join_processes
from .call_support import (CallRollback, Snapshot, backend_name, check_inference_accumulation, count_tensors,
                           to_cpu, to_device)
from .inspection import ExecutorInspection
from .replica_grouping import GroupableParameter
from .._logging import logger
from .._runtime import context
from .._runtime.config import RuntimeConfig
from .._runtime.batching.plan import BatchPlan, resolve_output_mode, split_inputs
from .._runtime.batching.signature import InputSignature, detach_inputs
from .._runtime.weights.modelcopy import TrainingMode, shallow_copy_module
from .._runtime.program.optimizer import (DeviceOptimizerSync, attach_optimizer,
                                 make_loss_scaler)
from .._runtime.program.device_loop import DeviceProgram, RngScope
from .._runtime.program.runner import SequentialRunner
from .._runtime.weights.constants import TensorConstants
from .._runtime.weights.sync import WeightSync
from ..enums import CommGroupType, OutputMode
from ..errors import Error
from ..optim.optimizers import SGD
from ..options.options import Options

__all__ = ["PoplarExecutor", "isRunningOnIpu"]

_NO_CONTEXT = contextlib.nullcontext()


def isRunningOnIpu() -> bool:
    """True while the model runs inside an executor ("on the IPU"), False otherwise.

    Lets a model take a different code path on the device:
    ``if poptorch.isRunningOnIpu(): ...``.
    """
    return context.is_running_on_ipu()


_EXECUTOR_IDS = itertools.count()

class PoplarExecutor(ExecutorInspection):
    """A wrapped model that runs whole device programs per call.

    Do not create it directly: use :py:func:`poptorch.trainingModel` or
    :py:func:`poptorch.inferenceModel`.
    """

    def __init__(self, model: torch.nn.Module, options: Options | None, training: bool,
                 poptorch_version: str, optimizer: Any = None,
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
        self._init_state(model, options, training, poptorch_version, optimizer,
                         user_model or model)

    def _init_state(self, model, options, training, version, optimizer, user_model) -> None:
        # Every attribute of the executor's state is created here.
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
        self._program: Any = None
        self._weights: Any = None
        self._attached = False
        self._compile_seconds: Any = None
        self._anchors: Any = {}
        self._device: Any = None
        self._constants: Any = None
        self._synthetic: Any = None
        self._replica_buffers: Any = None
        self._precision: Any = None
        self._optimizer_sync: Any = None
        self._backend: Any = None
        self._source: Any = None
        self._fast: Any = None
        self._once_key = next(_EXECUTOR_IDS)  # per-model "log once" messages
        # Set when compiling (None / empty before): every attribute of the executor's
        # state exists from here on, so that a lookup never falls through __getattr__.
        self._signature: Any = None
        self._tensor_constants: Any = None
        self._buffers_list: Any = []
        self._optimizer_keys: Any = None
        self._device_optimizer: Any = None
        self._casting: Any = None
        self._autocast_hooks: Any = None
        self._io_checked = False
        self._io_counts = (0, 0)
        self._pending_precompiled: Any = None  # poptorch.load: compiled at the first call
        self._pending_rng_state: Any = None
        self._replica_groupings: Any = {}
        self._config: Any = None  # RuntimeConfig of the options, made at compile time

    # ------------------------------------------------------------------ properties
    @property
    def model(self) -> torch.nn.Module:
        """The wrapped torch model (the user's module, with trained weights)."""
        if self._weights is not None:
            self._weights.to_host_if_needed()
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
        rng = program.rng
        if not rng.enabled:
            rng.enabled, rng.seed = True, seed
        rng.state = generator_state.clone()

    # ------------------------------------------------------------------ compile
    def _plan(self) -> BatchPlan:
        opts = self._options
        g = opts.Training.gradient_accumulation
        return BatchPlan(opts.device_iterations, g, opts.replication_factor,
                         opts.input_group_size, CommGroupType(opts.input_cgt))

    def _compile(self, args: tuple, kwargs: dict) -> None:
        from tqdm import tqdm
        opts = self._options
        self._fast = None
        t0 = time.perf_counter()
        _hooks.run_pre_compile_hooks()
        bar = tqdm(total=4, desc="Graph compilation", leave=False, unit="stage",
                   disable=not opts.show_compilation_progress_bar)
        try:
            plan = self._plan()
            split_inputs(plan, args, kwargs)  # check batch sizes before anything else
            from .program_setup import check_precompiled_inputs
            check_precompiled_inputs(self, args, kwargs)
            self._signature = InputSignature(self._model.forward, args, kwargs)
            self._tensor_constants = TensorConstants(self._model)
            self._buffers_list = list(self._model.buffers())
            if self._training:
                optimizer_rules.apply_mean_reduction_rule(opts, self._optimizer, False)
            self._config = RuntimeConfig.of(opts)  # what the engine reads from here on
            bar.update()
            runner, device = self._build_runner((args, kwargs))
            bar.update()
            self._weights_and_optimizer(device)
            # Only training needs the other processes; an inference model runs on its
            # own (a program may evaluate on process 0 alone).
            cross = self._join_processes(device, runner) if self._training else None
            runner = local_replica_runner(self, runner, plan, cross)
            if cross is not None:
                runner = cross.wrap_runner(runner, plan.per_step, device)
            bar.update()
            self._program = self._build_program(plan, runner, device, cross)
            program_setup.install_program_extras(self, self._program)
            backend = self._backend
            if backend in ("inductor", "fastest"):
                from .._runtime.program.compiled_step import compile_device_program
                compile_device_program(self._program, runner, self._model, device,
                                       self._model_name(),
                                       bool(opts.show_compilation_progress_bar),
                                       measure=backend == "fastest")
            if device.type == "cuda":  # the eager loop as one CUDA graph where it can be
                from .._runtime.program.cuda_graphs import install_cuda_graphs
                install_cuda_graphs(self._program, runner, self._model, device,
                                    self._model_name())
            from .program_setup import program_source
            self._source = program_source(self, args, kwargs)
            if opts.synthetic_data:
                from .._runtime.batching.synthetic import SyntheticInputs
                self._synthetic = SyntheticInputs(self._device)
                self._program.perf.synthetic = True
            bar.update()
        finally:
            bar.close()
        opts._freeze()
        opts._apply_effects()  # logging options; logs the options without effect here
        from .ipu_environment import log_ipu_only_environment
        log_ipu_only_environment()
        self._attached = True
        self._compile_seconds = time.perf_counter() - t0
        logger.debug("Compiled %s in %.3f s", self._model_name(), self._compile_seconds)
        from .._runtime.export import _apply_pending_rng
        _apply_pending_rng(self)
        _hooks.run_post_compile_hooks()

    def _build_runner(self, example=None):
        from .._runtime.placement.build import build_runner
        runner = build_runner(self._model, self._options, self._training, example=example)
        if runner is not None:
            device = getattr(runner, "output_device", torch.device("cpu"))
            self._device = getattr(runner, "input_device", device)
            self._backend = backend_name(self._options, device)
            return runner, device
        device = _devices.acquire_devices(self._options, 1)[0]
        self._device = device
        forward = self._model
        backend = backend_name(self._options, device)
        self._backend = backend
        return SequentialRunner(forward), device

    def _weights_to_device(self, **which) -> None:
        """Host -> device copy; every replica then holds the host's buffers."""
        self._weights.to_device(**which)
        buffers = self._replica_buffers
        if buffers is not None and which.get("buffers", True):
            buffers.broadcast()

    def _weights_and_optimizer(self, device: torch.device) -> None:
        updatable = self._options.updatable_named_buffers
        if updatable is not None:
            known = [n for n, _ in self._model.named_buffers()]
            unknown = [n for n in updatable if n not in known]
            if unknown:
                raise Error(f"updatableNamedBuffers: the model has no buffer named "
                            f"{', '.join(map(repr, unknown))}; its buffers are: "
                            f"{', '.join(known) or '(none)'}.")
        sync = WeightSync(self._user_model, self._model, device)
        self._weights = sync
        if self._training:
            attached = attach_optimizer(self._optimizer, self._model, self._user_model,
                                        sync)
            optimizer_rules.mark_compiled(self._optimizer, self._options)
            self._optimizer_keys = optimizer_rules.attribute_keys(
                self._optimizer)
            self._device_optimizer = attached
            self._sync_optimizer(self._optimizer, attached)

    def _sync_optimizer(self, user_optimizer: Any, device_optimizer: Any) -> None:
        sync = None
        if DeviceOptimizerSync.needed(user_optimizer, device_optimizer):
            sync = DeviceOptimizerSync(user_optimizer, device_optimizer)
        self._optimizer_sync = sync
        self._fast = None  # built again with this sync

    def _join_processes(self, device: torch.device, runner: Any = None):
        return join_processes(self._options, self._model, self._training,
                              self._device_optimizer, self._model_name(),
                              device, runner)

    def _build_program(self, plan: BatchPlan, runner, device, cross=None) -> DeviceProgram:
        config = self._config  # the options as compiled (RuntimeConfig)
        params = [p for p in self._model.parameters() if p.requires_grad]
        program = DeviceProgram(
            plan=plan, runner=runner, training=self._training,
            output_mode=resolve_output_mode(config.output_mode, self._training),
            output_return_period=config.output_return_period, params=params,
            optimizer=self._device_optimizer, config=config,
            rng=RngScope(config.random_seed, device),
            to_host=None if device.type == "cpu" else to_cpu,
            anchors=self._anchor_recorder(plan) if config.anchored_tensors else None,
            cross=cross)
        if self._training:
            program.set_scaler(make_loss_scaler(self._optimizer, config))
            from ..optim.attributes import snapshot_constants
            self._constants = snapshot_constants(self._optimizer)
        return program

    def _model_name(self) -> str:
        opts = self._options
        name = opts.model_name if opts.exists("model_name") else type(self._user_model).__name__
        return f"{name}.{'training' if self._training else 'inference'}"

    def compile(self, *args, **kwargs) -> None:
        """Compile the model for these inputs without running it (no-op if compiled)."""
        if self._program is None:
            self._compile(args, kwargs)

    # ------------------------------------------------------------------ run
    def __call__(self, *args, **kwargs) -> Any:
        if self._training and not torch.is_grad_enabled():
            return self._call_with_grad(args, kwargs)
        fast = self._fast  # executor/fast_call.py: None = not known yet, False = never
        if fast:
            result = fast(args, kwargs)
            if result is not MISS:
                return result
        args, kwargs = detach_inputs(args, kwargs, self._once_key)
        first = self._program is None
        if first:
            # compiling may already create optimizer state (momentum buffers): a failed
            # first call must not leave it behind
            user_optimizer = self._optimizer if self._training else None
            before = None if user_optimizer is None else user_optimizer.state_dict()
            try:
                self._compile(args, kwargs)
            except BaseException:
                if user_optimizer is not None:
                    user_optimizer.load_state_dict(before)
                raise
            snapshot: Snapshot | CallRollback | None = Snapshot(self._model, self._device_optimizer,
                                user_optimizer, before)
        else:
            self._check_signature(args, kwargs)  # before anything runs
            if self._tensor_constants:
                self._tensor_constants.restore()
            snapshot = CallRollback.for_call(self._program, self._buffers_list)
        # PopTorch's rules for overlap markers, checked on the first run (compiling)
        io_check = None if self._io_checked else \
            program_setup.overlap_check(self)
        if io_check is not None and not first:  # compiled by compile(): checked now
            snapshot = Snapshot(self._model, self._device_optimizer)
        if not self._attached:
            self.attachToDevice()
        device = self._device
        if self._synthetic is not None:
            args, kwargs = self._synthetic(args, kwargs)
        elif device.type != "cpu":
            args, kwargs = to_device((args, kwargs), device)
        casting = self._casting
        opt_sync = self._optimizer_sync
        if opt_sync is not None:
            opt_sync.before_run()
        try:
            source = self._source
            with self._mode, (source.first_call() if source.fresh else _NO_CONTEXT), \
                    (io_check or _NO_CONTEXT):
                if casting is None:
                    result = self._program.run(args, kwargs)
                else:
                    casting.observe(args, kwargs)
                    with casting:
                        result = self._program.run(args, kwargs)
            if isinstance(snapshot, Snapshot) and first:
                snapshot.check_buffers()
        except BaseException:
            # a failed call changes nothing: weights, optimizer state, buffers, loss
            # scale and the program's random stream are as before it
            if snapshot is not None:
                snapshot.restore()
            if first:  # ... and a failed first call leaves nothing compiled
                self.destroy()
            raise
        if io_check is not None and io_check.done:
            self._io_checked = True
        self._weights.mark_device_newer()
        if opt_sync is not None:
            opt_sync.after_run()
        if first:
            self._io_counts = (count_tensors((args, kwargs)),
                                           count_tensors(result))
        elif fast is None:
            self._fast = make_fast_call(self, args, kwargs)
        return result

    def _call_with_grad(self, args: tuple, kwargs: dict) -> Any:
        """A training call made under ``torch.no_grad()`` or ``torch.inference_mode()``:
        the device program keeps its own autograd state (on an IPU the host's grad
        mode does not reach the compiled training program), so the call trains as
        anywhere else. Inference tensors become ordinary tensors first (autograd
        cannot save them for the backward pass)."""
        with torch.inference_mode(False), torch.enable_grad():
            args, kwargs = pytree.tree_map(
                lambda t: t.clone() if isinstance(t, torch.Tensor) and t.is_inference()
                else t, (args, kwargs))
            return self(*args, **kwargs)

    def _check_signature(self, args: tuple, kwargs: dict) -> None:
        try:
            self._signature.check(args, kwargs)
        except Error:
            # A batch that does not divide into micro-batches has the clearer message.
            split_inputs(self._program.plan, args, kwargs)
            raise

    # ------------------------------------------------------------------ weights
    def copyWeightsToHost(self) -> None:
        """Copy the device weights (and buffers) to the user's model."""
        if self._loaded_not_run():
            return
        program = self._require_compiled("copyWeightsToHost")
        if hasattr(program.runner, "gather_weights"):  # stages on processes: collective
            program.runner.gather_weights()
        self._weights.to_host()

    def _loaded_not_run(self) -> bool:
        """A model from ``poptorch.load`` compiles at its first call; until then its
        weights live only in the host model, so weight copies have nothing to do."""
        return self._program is None and self._pending_precompiled is not None

    def copyWeightsToHostIfNeeded(self) -> bool:
        """Copy the weights to the host if the device has newer ones; True if copied."""
        return self._weights is not None and self._weights.to_host_if_needed()

    def copyWeightsToDevice(self) -> None:
        """Copy the user's model weights (and buffers) to the device."""
        if self._loaded_not_run():
            return
        self._require_compiled("copyWeightsToDevice")
        self._weights_to_device()

    def copyNamedBuffersToDevice(self) -> None:
        """Copy the user's model buffers (only) to the device: those named by
        ``Options.updatableNamedBuffers``, or all of them when it is not set."""
        self._require_compiled("copyNamedBuffersToDevice")
        names = self._options.updatable_named_buffers
        self._weights_to_device(params=False, buffers=True,
                                buffer_names=None if names is None else set(names))

    def load_state_dict(self, state_dict: dict, strict: bool = True):
        """Load a state dict into the wrapped model and synchronise the device."""
        result = self.model.load_state_dict(state_dict, strict)
        if self._weights is not None:
            self._weights_to_device()
        return result

    # ------------------------------------------------------------------ optimizer
    def setOptimizer(self, optimizer: Any) -> None:
        """Use ``optimizer``'s hyperparameters from the next call on (no recompilation).

        The optimizer state on the device (momentum, ...) is kept unless ``optimizer``
        carries state of its own.
        """
        if not self._training:
            raise Error("setOptimizer: this is an inference model; only a trainingModel "
                        "has an optimizer.")
        if self._program is not None:
            from ..optim.attributes import check_update
            optimizer_rules.apply_mean_reduction_rule(self._options, optimizer, True)
            optimizer_rules.warn_unexpected_attributes(
                self._optimizer_keys, optimizer, self._options.relax_optimizer_attributes_checks)
            try:
                check_update(self._constants, optimizer,
                             self._options.relax_optimizer_attributes_checks)
            except Error:
                if optimizer is self._optimizer or optimizer is self._device_optimizer:
                    # the refused change was made in the optimizer in force: undo it,
                    # so that the compiled value stays in force (as on an IPU)
                    from ..optim.attributes import restore_constants
                    restore_constants(self._constants, optimizer)
                raise
            attached = attach_optimizer(optimizer, self._model, self._user_model,
                                        self._weights, previous=self._device_optimizer)
            self._device_optimizer = attached
            self._program.optimizer = attached
            self._precision.prepare_optimizer(attached)
            self._sync_optimizer(optimizer, attached)
            optimizer_rules.mark_compiled(optimizer, self._options)
            self._program.set_scaler(make_loss_scaler(optimizer, self._config,
                                                      self._program.scaler))
        self._optimizer = optimizer

    @property
    def _executable(self) -> DeviceProgram | None:
        """The compiled program, None before compilation and after ``destroy()`` (the
        attribute libraries such as lightning-graphcore test, as upstream's)."""
        return self._program

    def isCompiled(self) -> bool:
        """True once the model is compiled (and not destroyed)."""
        return self._program is not None

    def isAttachedToDevice(self) -> bool:
        """True while the model holds its device."""
        return self._attached

    def detachFromDevice(self) -> None:
        """Release the device: weights are copied to the host first."""
        self._require_compiled("detachFromDevice")
        if not self._attached:
            raise Error("detachFromDevice: the model is not attached to a device.")
        self._weights.to_host_if_needed()
        self._attached = False
        self._fast = None  # (the fast path assumes an attached model)

    def attachToDevice(self) -> None:
        """Attach to the device again; the host weights are copied to the device."""
        self._require_compiled("attachToDevice")
        if self._attached:
            raise Error("attachToDevice: the model is already attached to a device.")
        self._weights_to_device()
        self._attached = True
        logger.debug("Attached to %s", self._device)

    def destroy(self) -> None:
        """Release the device and the compiled program; the next call compiles again."""
        if self._weights is not None:
            self._weights.to_host_if_needed()
        for name in ("_program", "_weights", "_device", "_replica_buffers", "_synthetic",
                     "_fast"):
            setattr(self, name, None)
        self._mode.forget()
        self._attached = False
        self._compile_seconds = None
        self._io_checked = False  # checked again when compiled again

    def _require_compiled(self, what: str) -> DeviceProgram:
        if self._program is None:
            raise Error(f"{what}: Model has not been compiled or has been destroyed. "
                        "Call it (or compile(*inputs)) first.")
        return self._program

    def save(self, filename: str, export_model: bool = True,
             save_rng_state: bool = True) -> None:
        """Save the compiled model (and, with export_model, the torch model) to a file."""
        from .._runtime.export import save_executor
        self._require_compiled("save")
        save_executor(self, filename, export_model, save_rng_state)

    def compileAndExport(self, filename: str, *args, export_model: bool = True,
                         **kwargs) -> None:
        """Compile for these inputs and save the result (with the compiled program and
        the input signature, see docs/precompilation.md) to ``filename``; the model's
        state is left as it was."""
        from .._runtime.export import compile_by_running
        compile_by_running(self, args, kwargs)
        self.save(filename, export_model=export_model)

    def loadExecutable(self, filename: str) -> None:
        """Restore a model saved with ``compileAndExport`` / ``save`` into this one."""
        from .._runtime.export import load_into
        load_into(self, filename)

    def train(self, mode: bool = True) -> "PoplarExecutor":
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

    def eval(self) -> "PoplarExecutor":
        """See :py:meth:`train`."""
        return self.train(False)

    def __getattr__(self, name: str) -> Any:
        """The explicit forwarding rule: a public attribute the executor does not have
        is read from the user's model (``pop.fc1.weight``, a model's own methods), as
        in PopTorch. Private names are never forwarded: every attribute of the
        executor's own state is private and created in ``_init_state``, so a misspelt
        one is an AttributeError instead of a silent read of the user's module."""
        if name.startswith("_") or "_user_model" not in self.__dict__:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute "
                                 f"{name!r}")
        value = getattr(self.model, name)
        if isinstance(value, torch.nn.Parameter):
            return GroupableParameter(self, name, value)
        return value

    def __repr__(self) -> str:
        """The wrapped model as :py:func:`poptorch.module_repr` shows it (with its
        BeginBlock annotations), as in PopTorch."""
        from ..ops.module_repr import module_repr
        return module_repr(self.model)
