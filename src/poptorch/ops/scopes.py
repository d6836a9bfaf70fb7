"""Scopes around model code: ``NameScope`` (operator name prefixes) and ``MultiConv``."""
from __future__ import annotations

import threading
from collections.abc import Callable, Collection
from numbers import Real
from types import TracebackType

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from .._logging import info_once
from ..enums import MultiConvPlanType
from ..errors import Error

__all__ = ["MultiConv", "NameScope", "current_name_scope"]

_local = threading.local()


def _scopes() -> list:
    if not hasattr(_local, "names"):
        _local.names = []
    return _local.names


def current_name_scope() -> str:
    """The nested name scopes of this thread joined with ``/`` ("" outside any)."""
    return "/".join(_scopes())


class NameScope:
    """Prefix the names of the operators run inside the block with ``name``.

    Here the scope is a ``torch.profiler.record_function`` range named with the full
    nested scope (``outer/inner``), so operators appear under it in profiler traces;
    :func:`current_name_scope` returns the active scope.

    >>> with poptorch.NameScope("CustomString"):
    ...     y = self.bmm(a, b)
    """

    def __init__(self, name: str) -> None:
        if not isinstance(name, str) or not name:
            raise Error(f"NameScope: name must be a non-empty string, got {name!r}.")
        self.name = name
        self._range: torch.profiler.record_function | None = None

    def __enter__(self) -> NameScope:
        _scopes().append(self.name)
        self._range = torch.profiler.record_function(current_name_scope())
        self._range.__enter__()
        return self

    def __exit__(self, type: type[BaseException] | None, value: BaseException | None,
                 traceback: TracebackType | None) -> None:
        if self._range is not None:
            self._range.__exit__(type, value, traceback)
        self._range = None
        _scopes().pop()


_CONVOLUTIONS = {F.conv1d, F.conv2d, F.conv3d, F.conv_transpose1d, F.conv_transpose2d,
                 F.conv_transpose3d, torch.conv1d, torch.conv2d, torch.conv3d}


class _ConvCounter(TorchFunctionMode):
    """Counts the convolutions called while active."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func: Callable[..., object], types: Collection[type],
                           args: tuple[object, ...] = (),
                           kwargs: dict[str, object] | None = None) -> object:
        if func in _CONVOLUTIONS:
            self.count += 1
        return func(*args, **(kwargs or {}))


class MultiConvValueError(Error, ValueError):
    """A bad MultiConv setting: a ``poptorch.Error`` that is also the ``ValueError``
    PopTorch raises for it."""


class MultiConvPlanError(Error, AssertionError):
    """A bad ``MultiConv.planType``: a ``poptorch.Error`` that is also the
    ``AssertionError`` PopTorch raises for it."""


class MultiConv:
    """Combine the convolutions run inside this scope into one multi-convolution.

    The IPU planned such convolutions together. On CPUs and GPUs they run as ordinary
    convolutions; the settings are validated and recorded (``self.settings``), and the
    number of convolutions seen is checked against per-convolution settings on exit.

    >>> with poptorch.MultiConv():
    ...     y = self.convA(x)
    ...     v = self.convB(u)
    """

    def __init__(self) -> None:
        self.settings: dict = {}
        self.num_convolutions: int | None = None
        self._counter: _ConvCounter | None = None

    def _per_conv(self, name: str, value: object, check: Callable[[object], bool],
                  what: str) -> MultiConv:
        values = list(value) if isinstance(value, (list, tuple)) else [value]
        if not values:
            raise Error(f"MultiConv.{name}: got an empty {type(value).__name__}.")
        for item in values:
            if not check(item):
                raise Error(f"MultiConv.{name}: each value must be {what}, got {item!r}.")
        self.settings[name] = value
        return self

    def availableMemoryProportions(self, value: float | list[float] | tuple[float, ...]
                                   ) -> MultiConv:
        """Available memory proportion per convolution, each in [0, 1)."""
        return self._per_conv(
            "availableMemoryProportions", value,
            lambda v: isinstance(v, Real) and not isinstance(v, bool) and 0 <= float(v) < 1,
            "a float in [0, 1)")

    def partialsTypes(self, value: torch.dtype | list[torch.dtype] | tuple[torch.dtype, ...]
                      ) -> MultiConv:
        """Partials type per convolution: ``torch.float`` or ``torch.half``."""
        values = value if isinstance(value, (list, tuple)) else [value]
        if any(v not in (torch.float32, torch.float16) for v in values):
            raise MultiConvValueError(
                f"MultiConv.partialsTypes: Invalid partials types {value!r}. Expecting "
                f"torch.float or torch.half (a torch.dtype, or one per convolution).")
        return self._per_conv("partialsTypes", value,
                              lambda v: v in (torch.float32, torch.float16),
                              "torch.float32 or torch.float16")

    def enableConvDithering(self, value: bool | list[bool] | tuple[bool, ...]) -> MultiConv:
        """Per-convolution dithering switch (bool, or one bool per convolution)."""
        return self._per_conv("enableConvDithering", value,
                              lambda v: isinstance(v, bool), "a bool")

    def planType(self, value: MultiConvPlanType) -> MultiConv:
        """The multi-convolution execution strategy."""
        if not isinstance(value, MultiConvPlanType):
            raise MultiConvPlanError(f"MultiConv.planType: Invalid plan type {value!r}: "
                                     f"use a poptorch.MultiConvPlanType.")
        self.settings["planType"] = value
        return self

    def perConvReservedTiles(self, value: int) -> MultiConv:
        """Tiles to reserve for each convolution."""
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise Error(f"MultiConv.perConvReservedTiles: value must be an int >= 0, "
                        f"got {value!r}.")
        self.settings["perConvReservedTiles"] = value
        return self

    def cycleBackOff(self, value: float) -> MultiConv:
        """Cycle back-off proportion, between 0 and 1."""
        if isinstance(value, bool) or not isinstance(value, Real) or not 0 <= value <= 1:
            raise Error(f"MultiConv.cycleBackOff: value must be a number between 0 and 1, "
                        f"got {value!r}.")
        self.settings["cycleBackOff"] = value
        return self

    def __enter__(self) -> MultiConv:
        info_once("MultiConv", "poptorch.MultiConv: on an IPU the convolutions in this "
                               "scope are planned together (plan type, memory proportions, "
                               "partials types, reserved tiles); on CPU/GPU devices the "
                               "settings have no effect (recorded only) and each "
                               "convolution runs as an ordinary convolution.")
        if not torch.compiler.is_compiling():
            if getattr(_local, "multiconv", False):
                raise Error("Nested poptorch.MultiConv is not supported: close the outer "
                            "MultiConv scope before opening another one.")
            _local.multiconv = True
            self._counter = _ConvCounter()
            self._counter.__enter__()
        return self

    def __exit__(self, type: type[BaseException] | None, value: BaseException | None,
                 traceback: TracebackType | None) -> None:
        counter, self._counter = self._counter, None
        if counter is None:
            return
        counter.__exit__(type, value, traceback)
        _local.multiconv = False
        self.num_convolutions = counter.count
        if type is not None:
            return
        if counter.count == 0:
            raise Error("poptorch.MultiConv: Unexpected end_multi_conv: no convolution ran "
                        "inside the MultiConv scope. Put the convolutions to combine "
                        "inside it, or remove the scope.")
        for name, setting in self.settings.items():
            if isinstance(setting, (list, tuple)) and len(setting) != counter.count:
                raise Error(f"MultiConv.{name}: {len(setting)} values were given but "
                            f"{counter.count} convolutions ran inside the MultiConv scope; "
                            "give one value per convolution or a single value for all.")
