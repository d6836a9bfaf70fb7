"""The autocast engine: regions, casting rules and the mode that applies them.

``poptorch.autocast`` (``autocasting.py``) is the public side; this module does the work
and imports nothing from the public layer.

* A **region** is opened by ``model.autocast()`` / ``layer.autocast(False)`` (a wrapped
  ``forward`` on the compiled copy), by the ``@poptorch.autocast`` decorator and by
  ``with poptorch.autocast():``. Regions nest per thread; the innermost one decides
  (the guide's hierarchical rule). No region means autocast is off.
* A **run** (:class:`AutocastRun`, entered by the executor around each call) says
  whether autocasting is enabled (``Precision.autocastEnabled``) and with which
  :class:`CastRules` (``Precision.autocastPolicy``). Outside a run regions are recorded
  but change nothing, so the same model runs as plain PyTorch on the host.
* While an enabled region is open inside a run, :class:`AutocastMode` (a
  :class:`~torch.overrides.TorchFunctionMode`, installed lazily so models without
  regions pay nothing) casts the floating-point arguments of every operator the rules
  name; autograd records the casts, so gradients reach float32 master weights.
* A module whose class the rules name is one unit: its wrapped forward casts every floating-point
  argument of every operator inside it (its weights included) to the unit's dtype
  (a **scope**), and operator rules do not apply within it.
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Collection
from dataclasses import dataclass
from types import TracebackType
from typing import TypeVar, cast

import torch
from torch.overrides import TorchFunctionMode

from ... import _logging
from ..._typing import UserInput, UserOutput
from ..attributes import own_attribute
from ..context import PerThread
from .casting import LOW_PRECISION, DefaultCasting, cast_floating, floating_args
from .precision import _NEVER_CAST, _writes_in_place

__all__ = [
    "AutocastMode",
    "AutocastRun",
    "CastRules",
    "canonical_name",
    "enter_region",
    "exit_region",
    "install_module_hooks",
    "op_name",
    "region_stack",
]

# Python operator spellings of torch operators: ``a * b`` calls ``Tensor.__mul__``.
_DUNDER_NAMES = {"truediv": "div", "floordiv": "floor_divide", "and": "bitwise_and",
                 "or": "bitwise_or", "xor": "bitwise_xor", "lshift": "bitwise_left_shift",
                 "rshift": "bitwise_right_shift", "mod": "remainder", "neg": "neg",
                 "abs": "abs", "invert": "bitwise_not"}
_REFLECTED = {"add", "sub", "mul", "matmul", "truediv", "floordiv", "mod", "pow", "and",
              "or", "xor", "lshift", "rshift", "divmod"}
# Alternative names of one operator.
_ALIASES = {"multiply": "mul", "divide": "div", "true_divide": "div", "subtract": "sub",
            "concat": "cat", "concatenate": "cat", "absolute": "abs",
            "negative": "neg", "clip": "clamp", "greater": "gt", "less": "lt"}


def op_name(func: Callable[..., object]) -> str:
    """The operator a torch function, Tensor method or Python operator stands for:
    ``torch.mul``, ``Tensor.mul``, ``Tensor.__mul__`` and ``Tensor.__rmul__`` all give
    ``"mul"``; ``torch.nn.functional.relu`` gives ``"relu"``."""
    return canonical_name(getattr(func, "__name__", "") or "")


def canonical_name(name: str) -> str:
    """``op_name`` for a name given as a string (``"__rmul__"`` -> ``"mul"``)."""
    if name.startswith("__") and name.endswith("__"):
        name = name[2:-2]
        if name.startswith("r") and name[1:] in _REFLECTED:
            name = name[1:]
        name = _DUNDER_NAMES.get(name, name)
    return _ALIASES.get(name, name)


@dataclass(frozen=True)
class CastRules:
    """Operator names and module classes of each list of a casting policy."""
    fp16_ops: frozenset = frozenset()
    fp32_ops: frozenset = frozenset()
    promote_ops: frozenset = frozenset()
    demote_ops: frozenset = frozenset()
    fp16_modules: tuple = ()
    fp32_modules: tuple = ()
    promote_modules: tuple = ()
    demote_modules: tuple = ()

    def op_dtype(self, name: str, tensors: list) -> torch.dtype | None:
        """The dtype operator ``name`` computes in given its floating arguments, or
        None to leave it alone."""
        if not tensors:
            return None
        if name in self.fp16_ops:
            return _low_dtype(tensors)
        if name in self.fp32_ops:
            return torch.float32
        if name in self.promote_ops and _mixed(tensors):
            return torch.float32
        if name in self.demote_ops and _mixed(tensors):
            return _low_dtype(tensors)
        return None

    def module_dtype(self, module: torch.nn.Module, tensors: list
                     ) -> tuple[bool, torch.dtype | None]:
        """(listed, dtype) for a module: whether its class is in a list, and the dtype
        it computes in (None: listed in promote/demote but not given mixed precision)."""
        if isinstance(module, self.promote_modules) and _mixed(tensors):
            return True, torch.float32
        if isinstance(module, self.demote_modules) and _mixed(tensors):
            return True, _low_dtype(tensors)
        if isinstance(module, self.fp16_modules):
            return True, _low_dtype(tensors)
        if isinstance(module, self.fp32_modules):
            return True, torch.float32
        listed = isinstance(module, self.promote_modules + self.demote_modules)
        return listed, None


def _mixed(tensors: list) -> bool:
    dtypes = {t.dtype for t in tensors}
    return torch.float32 in dtypes and any(d in dtypes for d in LOW_PRECISION)


def _low_dtype(tensors: list) -> torch.dtype:
    """float16, or bfloat16 when the arguments carry bfloat16 and no float16."""
    dtypes = {t.dtype for t in tensors}
    if torch.bfloat16 in dtypes and torch.float16 not in dtypes:
        return torch.bfloat16
    return torch.float16


# --------------------------------------------------------------------------------------
# Per-thread region stack and run configuration

_REGION, _SCOPE = 0, 1


class _ThreadState:
    """One thread's regions, pushed mode and running call."""

    __slots__ = ("mode", "owner", "run", "stack")

    def __init__(self) -> None:
        self.stack: list = []  # open regions, innermost last
        self.mode: AutocastMode | None = None  # the AutocastMode pushed in this thread
        self.owner: int | AutocastRun | None = None  # who pushed it: a depth or a run
        self.run: AutocastRun | None = None  # the AutocastRun of this thread's call


_per_thread = PerThread(_ThreadState)  # (read once per call)
_global_run = None  # the run entered last in any thread (worker threads fall back to it)


def region_stack() -> list:
    """This thread's open regions, innermost last: ``(REGION, enabled)`` or
    ``(SCOPE, dtype or None)`` entries."""
    return _per_thread.state.stack


def _current_run() -> AutocastRun | None:
    run = _per_thread.state.run
    return run if run is not None else _global_run


def _region_open() -> bool:
    """True if operator rules apply at this point (the innermost entry is an enabled
    region)."""
    stack = region_stack()
    return bool(stack) and stack[-1] == (_REGION, True)


def _push(entry: tuple) -> None:
    tls = _per_thread.state
    stack = tls.stack
    if tls.mode is None:
        run = _current_run()
        if run is not None and run.enabled:
            _start_mode(run, owner=len(stack))
        elif run is None and entry == (_REGION, True):
            _logging.info_once(
                "autocast.outside", "poptorch.autocast: this region runs outside a "
                "PopTorch model and casts nothing; autocasting applies inside models "
                "wrapped by poptorch.inferenceModel / trainingModel.")
    stack.append(entry)


def _pop() -> None:
    tls = _per_thread.state
    stack = tls.stack
    stack.pop()
    if tls.mode is not None and tls.owner == len(stack):
        _stop_mode()


def _start_mode(run: AutocastRun, owner: int | AutocastRun) -> None:
    mode = AutocastMode(run.rules)
    mode.__enter__()
    tls = _per_thread.state
    tls.mode, tls.owner = mode, owner


def _stop_mode() -> None:
    tls = _per_thread.state
    mode = cast(AutocastMode, tls.mode)  # (called while a mode is pushed)
    tls.mode, tls.owner = None, None
    mode.__exit__(None, None, None)


def enter_region(enabled: bool) -> None:
    """Open a region (decorator, context manager or ``module.autocast``)."""
    _push((_REGION, bool(enabled)))


def exit_region() -> None:
    """Close the innermost region."""
    _pop()


class AutocastRun:
    """Entered around each call of one compiled model: marks the call as running with
    ``enabled`` / ``rules``, and enters ``default_casting`` (the float16 rules of
    ``_runtime/numerics/casting.py``, or None) too, so that one wrapper does both."""

    def __init__(self, enabled: bool, rules: CastRules,
                 default_casting: DefaultCasting | None = None) -> None:
        self.enabled = bool(enabled)
        self.rules = rules
        self.default_casting = default_casting
        # Worker threads (pipelines) need the float16 rules' mode too.
        self.thread_context = (None if default_casting is None
                               else default_casting.thread_context)
        self._saved: list = []

    def observe(self, args: tuple, kwargs: dict) -> None:
        """Tell the float16 rules the inputs of the coming call."""
        if self.default_casting is not None:
            self.default_casting.observe(args, kwargs)

    def __enter__(self) -> None:
        if self.default_casting is not None:
            self.default_casting.__enter__()
        self.enter_run()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        try:
            self.exit_run()
        finally:
            if self.default_casting is not None:
                self.default_casting.__exit__(exc_type, exc, tb)

    def enter_run(self) -> None:
        """:py:meth:`__enter__` without the float16 rules (for calls known to need no
        casting, see ``DefaultCasting.settled``); paired with :py:meth:`exit_run`."""
        global _global_run
        tls = _per_thread.state
        self._saved.append((tls.run, _global_run))
        tls.run = _global_run = self
        if tls.stack and tls.mode is None and self.enabled:
            _start_mode(self, owner=self)  # called inside ``with poptorch.autocast():``

    def exit_run(self) -> None:
        """Undo :py:meth:`enter_run`."""
        global _global_run
        tls = _per_thread.state
        try:
            if tls.mode is not None and tls.owner is self:
                _stop_mode()
        finally:
            tls.run, _global_run = self._saved.pop()


class AutocastMode(TorchFunctionMode):
    """Casts operator arguments as the innermost region / scope and the rules say."""

    def __init__(self, rules: CastRules) -> None:
        super().__init__()
        self.rules = rules

    def __torch_function__(self, func: Callable[..., object], types: Collection[type],
                           args: tuple[object, ...] = (),
                           kwargs: dict[str, object] | None = None) -> object:
        kwargs = kwargs or {}
        stack = region_stack()
        if not stack or func in _NEVER_CAST or _writes_in_place(func, kwargs):
            return func(*args, **kwargs)
        kind, value = stack[-1]
        if kind == _REGION and not value:
            return func(*args, **kwargs)
        tensors = floating_args(args, [])
        if kwargs:
            floating_args(kwargs.values(), tensors)
        if kind == _SCOPE:
            dtype = value if tensors else None
        else:
            dtype = self.rules.op_dtype(op_name(func), tensors)
        if dtype is not None:
            args = tuple(cast_floating(a, dtype) for a in args)
            kwargs = {k: cast_floating(v, dtype) for k, v in kwargs.items()}
        return func(*args, **kwargs)


# --------------------------------------------------------------------------------------
# Module hooks


class _ForwardPatch:
    """Handle of a wrapped ``module.forward``; :meth:`remove` restores it."""

    def __init__(self, module: torch.nn.Module, wrapper: Callable) -> None:
        self.module = module
        self.previous: Callable[..., UserOutput] | None = own_attribute(module, "forward")
        self.had_own = self.previous is not None
        self.wrapper = wrapper
        module.forward = wrapper

    def remove(self) -> None:
        if own_attribute(self.module, "forward") is not self.wrapper:
            return  # replaced since: leave the newer forward alone
        if self.had_own and self.previous is not None:  # (had_own: previous is not None)
            self.module.forward = self.previous
        else:
            del self.module.forward


class _AutocastForward:
    """The wrapped ``forward`` of one module: opens the module's autocast region / scope
    around the original ``forward``.

    It is an attribute of the module itself (so direct ``layer.forward(x)`` calls are
    covered too), which ``torch.save(model)`` pickles: it pickles as the ``forward`` it
    wraps, so a saved model reloads as a plain module.
    """

    def __init__(self, module: torch.nn.Module, setting: bool | None,
                 rules: CastRules | None, previous: Callable[..., UserOutput] | None) -> None:
        self.module, self.setting, self.rules = module, setting, rules
        self.previous = previous  # the instance-level forward it shadows, or None
        self.inner = module.forward  # bound method, or an instance-level function

    def __call__(self, *args: UserInput, **kwargs: UserInput) -> UserOutput:
        pushed = 0
        try:
            if self.setting is not None:
                enter_region(self.setting)
                pushed += 1
            if self.rules is not None and _region_open():
                tensors = floating_args(args, [])
                floating_args(kwargs.values(), tensors)
                floating_args(self.module.parameters(), tensors)
                listed, dtype = self.rules.module_dtype(self.module, tensors)
                if listed:
                    _push((_SCOPE, dtype))
                    pushed += 1
            return self.inner(*args, **kwargs)
        finally:
            for _ in range(pushed):
                _pop()

    def __reduce__(self) -> tuple[Callable[..., object], tuple[object, ...]]:
        if self.previous is not None:
            return _same, (self.previous,)
        return functools.partial, (type(self.module).forward, self.module)


T = TypeVar("T")


def _same(value: T) -> T:
    return value


def _wrap_forward(module: torch.nn.Module, setting: bool | None,
                  rules: CastRules | None) -> _ForwardPatch:
    previous = own_attribute(module, "forward")
    return _ForwardPatch(module, _AutocastForward(module, setting, rules, previous))


def install_module_hooks(modules: list[tuple[torch.nn.Module, bool | None]],
                         rules: CastRules) -> list:
    """Wrap the ``forward`` of every ``(module, setting)`` pair that needs it:
    ``setting`` is the module's own ``autocast`` switch (None if unset); modules whose
    class ``rules`` names also get their scope. Wrapping ``forward`` (not hooks) also
    covers code calling ``layer.forward(x)`` directly. Returns handles with
    ``remove()``."""
    classes = (rules.fp16_modules + rules.fp32_modules + rules.promote_modules
               + rules.demote_modules)
    handles = []
    for module, setting in modules:
        listed = bool(classes) and isinstance(module, classes)
        if setting is None and not listed:
            continue
        handles.append(_wrap_forward(module, setting, rules if listed else None))
    return handles
