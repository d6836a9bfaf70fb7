"""Every private PyTorch name OpenPopTorch relies on, in one place.

PyTorch may rename or remove a private name in any release. Each one we use is bound
(or, for heavy modules, resolved on first use) here, with the reason we use it instead
of a public API; ``tests/test_torch_internals.py`` resolves every entry of
:data:`REQUIRED`, so a torch release that removes one fails that test by name instead
of failing somewhere deep inside a model run. Names in :data:`FALLBACKS` have a
fallback: where a release lacks one, the fallback runs and the test of that entry says
so. The supported range of torch releases is stated in ``pyproject.toml``
(``scripts/test_torch_range.sh`` runs the whole suite on each release of it).
"""
from __future__ import annotations

import collections
import importlib
from collections.abc import Callable
from typing import Any, cast

import torch
from torch.autograd import profiler as _profiler
from torch.optim import optimizer as _torch_optimizer

# Nested inputs and outputs (tuples, dicts, dataclass-like outputs) are flattened and
# rebuilt with the pytree utilities torch.compile, torch.export and DTensor use; torch
# has no public module for them yet.
from torch.utils import _pytree as pytree

TorchPrivate = Any
"""An object of torch's private API found by name (:func:`resolve`): torch does not type
it for its users, so it is anything here; the callers use it as torch does."""

__all__ = [
    "FALLBACKS",
    "MODULE_CALL_CODE",
    "REQUIRED",
    "REQUIRED_ON_INSTANCES",
    "DisableAutocast",
    "DisableTorchFunction",
    "NormBase",
    "TorchDispatchMode",
    "call_hooks",
    "current_graph_task_id",
    "disable_current_modes",
    "disable_dynamo",
    "dispatch_get_all_op_names",
    "dispatch_has_kernel_for_dispatch_key",
    "dynamo",
    "dynamo_config_patch",
    "dynamo_counters",
    "dynamo_eager_numerics",
    "fake_impl_entry",
    "foreach_copy_",
    "foreach_div_",
    "foreach_mul_",
    "forward_pre_hooks",
    "inductor_cache_dir",
    "inductor_codecache",
    "inductor_cpp_compiler",
    "optimizer_hooks_registered",
    "optimizer_post_hooks_registered",
    "profiler_enabled",
    "pytree",
    "remove_worker_pids",
    "resolve",
    "set_grad_enabled",
    "step_needs_wrapper",
    "tensor_inputs_check",
    "top_saved_tensors_default_hooks",
    "torch_function_stack_depth",
]

# The grad-mode switch itself: ``torch.no_grad()`` builds a context-manager object per
# call (a measurable part of a small model's per-call overhead on the fast path).
set_grad_enabled = torch._C._set_grad_enabled

# One kernel launch for a list of tensors (gradient scaling, replica weight copies);
# torch.optim's own foreach implementations use the same functions.
foreach_copy_ = torch._foreach_copy_
foreach_div_ = torch._foreach_div_
foreach_mul_ = torch._foreach_mul_

# Disables __torch_function__ handling (modes and subclasses) in a scope: marker
# bookkeeping must not be seen by the user's torch function modes.
DisableTorchFunction = torch._C.DisableTorchFunction

# Keeps torch.compile out of host-side work (a graph break) without importing
# torch._dynamo up front (torch.compiler.disable imports it: ~0.5 s at import).
disable_dynamo = torch._disable_dynamo


def torch_function_stack_depth() -> int:
    """How many torch function modes are active: a compiled call cannot run inside
    one (torch.compile traces through the mode)."""
    return torch._C._len_torch_function_stack()


_global_pre_hooks = _torch_optimizer._global_optimizer_pre_hooks
_global_post_hooks = _torch_optimizer._global_optimizer_post_hooks


def optimizer_hooks_registered(optimizer: torch.optim.Optimizer) -> bool:
    """Whether any step hook (this optimizer's or torch's global ones) is registered:
    ``Optimizer.step``'s wrapper runs them; our fast step skips the wrapper only when
    none is (``torch.optim.optimizer`` keeps the global ones in private dicts)."""
    return bool(optimizer._optimizer_step_pre_hooks or optimizer._optimizer_step_post_hooks
                or _global_pre_hooks or _global_post_hooks)


def optimizer_post_hooks_registered(optimizer: torch.optim.Optimizer) -> bool:
    """Whether a step hook that runs after the update (this optimizer's or torch's
    global ones) is registered: it may fail once the parameters have changed."""
    return bool(optimizer._optimizer_step_post_hooks or _global_post_hooks)


def profiler_enabled() -> bool:
    """Whether torch.profiler records right now (then the optimizer's wrapped step runs,
    so that its range shows in the trace); torch keeps the flag in a private global."""
    return bool(_profiler._is_profiler_enabled)


def step_needs_wrapper(optimizer: torch.optim.Optimizer) -> bool:
    """:func:`optimizer_hooks_registered` or :func:`profiler_enabled`, in one call (it
    runs once per training step)."""
    return bool(optimizer._optimizer_step_pre_hooks or optimizer._optimizer_step_post_hooks
                or _global_pre_hooks or _global_post_hooks or _profiler._is_profiler_enabled)


# Recomputation (placement/recompute.py) stacks its saved-tensor hooks on the enclosing
# ones, tells a backward pass from a forward one and replays a segment's forward with
# nothing of the caller's modes, torch functions or autocast around it.
top_saved_tensors_default_hooks = torch._C._autograd._top_saved_tensors_default_hooks
current_graph_task_id = torch._C._current_graph_task_id
DisableAutocast = torch._C._DisableAutocast
# The base class of Python dispatch modes (recomputation's tape), documented in torch's
# "extending" notes but kept in a private module.
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._python_dispatch import _disable_current_modes as disable_current_modes  # noqa: E402

# The code object of Module.__call__'s implementation: recomputation finds the
# outermost module running in this thread by walking the frames for it.
MODULE_CALL_CODE = torch.nn.Module._call_impl.__code__

# The common base of BatchNorm* and InstanceNorm* (layers with running statistics),
# which the float16 rules keep in float32.
NormBase = torch.nn.modules.batchnorm._NormBase


def forward_pre_hooks(module: torch.nn.Module) -> dict[int, Callable[..., object]]:
    """``module``'s forward pre-hooks by handle id. A ``BeginBlock`` annotation is one of
    them (placement/markers.py): found there again, also on copies of the module (which
    copy their hooks), and removed there; ``nn.Module`` has no public listing."""
    return module._forward_pre_hooks


def call_hooks(module: torch.nn.Module) -> list[Callable[..., object]]:
    """``module``'s forward and backward hooks (not its pre-hooks): the stage-graph
    capture keeps the calls of a model with such hooks as module calls, so that they
    run on every call; ``nn.Module`` has no public listing."""
    return [*module._forward_hooks.values(), *module._backward_hooks.values(),
            *module._backward_pre_hooks.values()]


# custom_op: the operators of a namespace, whether one has a shape function (Meta
# kernel) and its registered fake implementation; torch.library has no query API.
dispatch_get_all_op_names = torch._C._dispatch_get_all_op_names
dispatch_has_kernel_for_dispatch_key = torch._C._dispatch_has_kernel_for_dispatch_key


def fake_impl_entry(qualname: str) -> TorchPrivate:
    """torch.library's registry entry of operator ``qualname`` (its fake kernel)."""
    return resolve("torch._library.simple_registry.singleton").find(qualname)


def inductor_cache_dir() -> str:
    """Where inductor keeps its compiled kernels (the precompiled files carry them)."""
    return resolve("torch._inductor.runtime.cache_dir_utils.cache_dir")()


def inductor_cpp_compiler() -> TorchPrivate:
    """The C++ compiler inductor would build with (raises when there is none): the
    automatic backend skips compiling on a machine without one."""
    return resolve("torch._inductor.cpp_builder.get_cpp_compiler")()


def inductor_codecache() -> TorchPrivate:
    """``torch._inductor.codecache``: its header precompilation is replaced while
    precompiled kernels are installed."""
    return importlib.import_module("torch._inductor.codecache")


def dynamo() -> TorchPrivate:
    """``torch._dynamo``, imported on first use (a large import): its exception types
    tell a failed capture from the model's own errors."""
    return importlib.import_module("torch._dynamo")


def dynamo_counters() -> dict[str, collections.Counter[str]]:
    """torch._dynamo's event counters (``["frames"]["total"]``: frames compiled,
    ``["stats"]["unique_graphs"]``: graphs compiled): how tests and benchmarks count
    (re)compilations; torch has no public counter."""
    return resolve("torch._dynamo.utils.counters")


def dynamo_config_patch(**settings: object) -> TorchPrivate:
    """``torch._dynamo.config.patch(**settings)``: dynamo settings scoped to our own
    compiles, never changed for the process."""
    return dynamo().config.patch(**settings)


def dynamo_eager_numerics() -> dict[str, bool]:
    """Dynamo settings under which a traced step rounds as the eager kernels do, for
    ``dynamo_config_patch(**dynamo_eager_numerics())``; empty where none is needed.

    torch 2.11's dynamo rewrites ``x.add_(y, alpha=a)`` (the update of torch.optim's
    SGD) into ``x.add_(y * a)``: two roundings where the eager CPU kernel makes one (a
    fused multiply-add), so a compiled SGD step is not bitwise the eager one there
    (from 2.13 on, only a tensor ``alpha`` is rewritten). ``enable_dynamo_decompositions
    =False`` keeps the eager op. Side effect on 2.11: a tensor ``alpha`` (a tensor
    learning rate) then cannot be captured whole. Empty where this torch has no such
    setting (the fallback: dynamo's own rewrites stay)."""
    if TORCH_RELEASE >= (2, 13):  # from 2.13 on dynamo keeps the eager op for a number
        return {}
    config = dynamo().config
    if hasattr(config, "enable_dynamo_decompositions"):
        return {"enable_dynamo_decompositions": False}
    return {}


TORCH_RELEASE = tuple(int(part) for part in torch.__version__.split(".")[:2])
"""(major, minor) of the torch in use."""


def tensor_inputs_check(tensors: tuple) -> Callable[..., bool] | None:
    """A check, in C++, that later inputs are plain tensors like ``tensors``: called as
    ``check(*args)`` with as many arguments, True when each is of the same Python
    type, dtype, device, sizes, strides and ``requires_grad`` (dynamo's own guard on
    tensor inputs, ``TensorGuards``). The per-call fast path runs it instead of
    comparing these in Python (about 0.4 us per tensor, a measurable part of a small
    model's call). None where this torch has no such guard."""
    try:
        from torch._C._dynamo.guards import TensorGuards
        # (one list of static sizes / strides per tensor; the stub's type is narrower)
        sizes = cast("list[torch.SymInt | None]", [list(t.shape) for t in tensors])
        strides = cast("list[torch.SymInt | None]", [list(t.stride()) for t in tensors])
        guard = TensorGuards(*tensors, dynamic_dims_sizes=sizes,
                             dynamic_dims_strides=strides)
    except Exception:
        return None
    return guard.check


def remove_worker_pids(iterator_id: int) -> None:
    """Unregister a DataLoader iterator's workers from torch's SIGCHLD handler
    (``data/faults.py``: a dead worker's siblings are stopped without the handler
    raising the death again); torch keeps the registry in a private module."""
    resolve("torch.utils.data._utils.signal_handling._remove_worker_pids")(iterator_id)


def resolve(dotted: str) -> TorchPrivate:
    """The object named ``dotted`` (``"module.attr.attr"``): imports the longest
    importable module prefix, then reads attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(dotted)


# Every private name used anywhere in the package, with where and why. Other modules
# use them through the bindings above, except the DataLoader's own private members
# (data/loader.py overrides ``_index_sampler``; data/faults.py stops workers with
# ``_shutdown_workers`` and reads torch's worker signal handling), which are listed
# here so that the test checks them too.
REQUIRED: dict[str, str] = {
    "torch.utils._pytree.tree_flatten": "nested inputs / outputs (everywhere)",
    "torch.utils._pytree.tree_unflatten": "nested inputs / outputs (everywhere)",
    "torch.utils._pytree.tree_map": "nested inputs / outputs (everywhere)",
    "torch.utils._pytree.tree_map_only": "nested outputs",
    "torch.utils._pytree.tree_leaves": "nested inputs / outputs (everywhere)",
    "torch.utils._pytree.tree_flatten_with_path": "input names in error messages",
    "torch.utils._pytree.keystr": "input names in error messages",
    "torch.utils._pytree.register_pytree_node": "dict-like outputs as pytree nodes",
    "torch.utils._pytree._deregister_pytree_node": "tests' temporary registrations",
    "torch.utils._pytree.SUPPORTED_NODES": "which output classes pytree knows",
    "torch.utils._pytree.TreeSpec": "signatures of compiled inputs",
    "torch._C._set_grad_enabled": "fast-path grad mode switch",
    "torch._C._dynamo.guards.TensorGuards": "fast-path input check",
    "torch._foreach_copy_": "replica weight copies, sharded weights' gathers",
    "torch._foreach_div_": "gradient reduction",
    "torch._foreach_mul_": "gradient reduction",
    "torch._C.DisableTorchFunction": "overlap markers, recomputation replay",
    "torch._disable_dynamo": "host ops and print_tensor outside compiled graphs",
    "torch._C._len_torch_function_stack":
        "compiled call / CUDA graph refused inside a function mode",
    "torch.optim.optimizer._global_optimizer_pre_hooks": "fast optimizer step",
    "torch.optim.optimizer._global_optimizer_post_hooks": "fast optimizer step",
    "torch.autograd.profiler._is_profiler_enabled": "fast optimizer step",
    "torch._dynamo.exc.TorchDynamoException": "a failed capture (compiled fallback)",
    "torch._dynamo.exc.BackendCompilerFailed": "a failed code generation (compiled fallback)",
    "torch._dynamo.utils.counters": "compile counts in tests and benchmarks (no public API)",
    "torch._dynamo.config.patch": "dynamo settings scoped to our compiles",
    "torch._dynamo.config.enable_dynamo_decompositions": "compiled pieces round as eager",
    "torch._C._autograd._top_saved_tensors_default_hooks": "recomputation",
    "torch._C._current_graph_task_id": "recomputation",
    "torch._C._DisableAutocast": "recomputation replay",
    "torch.utils._python_dispatch._disable_current_modes": "recomputation replay",
    "torch.utils._python_dispatch.TorchDispatchMode": "recomputation",
    "torch.nn.Module._call_impl": "recomputation (the outermost module's frame)",
    "torch.nn.modules.batchnorm._NormBase": "float16 rules: norm layers in float32",
    "torch._inductor.runtime.cache_dir_utils.cache_dir": "precompiled kernels",
    "torch._inductor.codecache": "precompiled kernels (header precompilation)",
    "torch._inductor.cpp_builder.get_cpp_compiler": "automatic backend: is there a compiler",
    "torch._C._dispatch_get_all_op_names": "custom_op: listing a namespace's ops",
    "torch._C._dispatch_has_kernel_for_dispatch_key": "custom_op: shape functions",
    "torch._library.simple_registry.singleton": "custom_op: fake implementations",
    "torch.utils.data.DataLoader._index_sampler": "DataLoader: combined batches",
    "torch.utils.data.dataloader._MultiProcessingDataLoaderIter._shutdown_workers":
        "DataLoader: worker faults, prompt shutdown",
    "torch.utils.data._utils.signal_handling._remove_worker_pids":
        "DataLoader: worker deaths",
}

# Private names with a fallback, and what runs instead where a torch release lacks one
# (tests/test_torch_internals.py checks that the fallback is what runs there).
FALLBACKS: dict[str, str] = {
    "torch._C._dynamo.guards.TensorGuards":
        "tensor_inputs_check() is None: the fast path compares dtypes and shapes in Python",
    "torch._dynamo.config.enable_dynamo_decompositions":
        "dynamo_eager_numerics() is empty: traces keep dynamo's own rewrites",
}

# Private attributes that torch sets on instances (checked on a fresh instance).
REQUIRED_ON_INSTANCES: dict[str, tuple[str, ...]] = {
    "torch.optim.SGD": ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks"),
}
