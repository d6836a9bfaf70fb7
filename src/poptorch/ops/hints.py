"""Identity ops that carry IPU planning hints.

The IPU compiler used these hints to plan memory and host IO. On CPUs and GPUs there
is nothing to plan, so each op validates its arguments, records the latest value (see
:func:`recorded_hints`), logs once at INFO that it has no effect here, and returns its
input unchanged.

PopTorch also refuses misplaced overlap markers when it compiles a model. While a
wrapped model is captured as a graph, or while its first forward runs, the overlap
markers report to the checker of this thread (``context.overlap_checker()``,
``_runtime/program/overlapped_io.py``): a graph capture records them as nodes
(``fx.Proxy`` values are accepted as tensors), a first forward gets an alias of what
they mark (same storage and values), so that the checker can tell a use of the marked
tensor from a use of the raw one.
"""
from __future__ import annotations

import threading
from typing import TypedDict, TypeVar

import torch
import torch.fx

from .._logging import info_once
from .._runtime import context
from ..enums import OverlapMode
from ..errors import Error

__all__ = [
    "recorded_hints",
    "set_available_memory",
    "set_overlap_for_input",
    "set_overlap_for_output",
]

_lock = threading.Lock()
_IPU_EFFECT = {
    "set_available_memory": "bounds the proportion of tile memory the operation producing "
                            "the tensor may use for temporaries (its planning trades "
                            "memory for speed)",
    "set_overlap_for_input": "overlaps the host-to-IPU transfer of these inputs with "
                             "compute, using the IO tiles (TensorLocations.numIOTiles)",
    "set_overlap_for_output": "overlaps the IPU-to-host transfer of these outputs with "
                              "compute, using the IO tiles (TensorLocations.numIOTiles)",
}
class _Hint(TypedDict):
    calls: int
    last: object  # the value the user gave


_hints: dict[str, _Hint] = {}


def _record(op: str, value: object) -> None:
    if torch.compiler.is_compiling():
        # traced by torch.compile (the compiled device program): recorded when the
        # model ran eagerly (its first call); a lock would split the graph
        return
    with _lock:
        entry = _hints.setdefault(op, {"calls": 0, "last": None})
        entry["calls"] += 1
        entry["last"] = value
    info_once(op, f"poptorch.{op}({value!r}): on an IPU it {_IPU_EFFECT[op]}; on "
                  "CPU/GPU devices it has no effect (recorded only).")


def recorded_hints() -> dict[str, dict[str, object]]:
    """``{op name: {"calls": n, "last": last value}}`` for every hint op used so far."""
    with _lock:
        return {op: dict(entry) for op, entry in _hints.items()}


def set_available_memory(tensor: torch.Tensor,
                         available_memory_proportion: float) -> torch.Tensor:
    """Record the proportion (0 to 1) of tile memory the op producing ``tensor`` may use
    for temporaries, and return ``tensor``. A hint only: no effect on CPU/GPU."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError("set_available_memory expects a torch.Tensor, got "
                        f"{type(tensor).__name__}.")
    proportion = available_memory_proportion
    if isinstance(proportion, bool) or not isinstance(proportion, (int, float)) \
            or not 0.0 <= proportion <= 1.0:
        raise Error("set_available_memory: available_memory_proportion must be a number "
                    f"between 0.0 and 1.0, got {proportion!r}.")
    _record("set_available_memory", float(proportion))
    return tensor


class OverlapTypeError(Error, TypeError):
    """An overlap marker applied to something other than tensors: the ``poptorch.Error``
    PopTorch raises, also a ``TypeError``."""


def _check_tensors(structure: object, op: str, what: str) -> None:
    if isinstance(structure, (torch.Tensor, torch.fx.Proxy)):  # (Proxy: graph capture)
        return
    if isinstance(structure, (list, tuple)):
        for item in structure:
            _check_tensors(item, op, what)
        return
    if isinstance(structure, dict):
        for item in structure.values():
            _check_tensors(item, op, what)
        return
    kind = "inputs" if op == "set_overlap_for_input" else "outputs"
    raise OverlapTypeError(
        f"You may only set overlap for torch.tensor {kind}. {type(structure)} is not "
        f"supported. {op}: {what} must be a tensor or a tuple, list or dict of tensors; "
        f"found a {type(structure).__name__}.")


_Structure = TypeVar("_Structure")


def _set_overlap(structure: _Structure, mode: OverlapMode, op: str, what: str) -> _Structure:
    if not isinstance(mode, OverlapMode):
        raise Error(f"{op}: mode must be a poptorch.OverlapMode, got {mode!r}.")
    _check_tensors(structure, op, what)
    _record(op, mode)
    # (a capture with torch.export checks the markers on its graph; dynamo does not)
    checker = None if torch.compiler.is_compiling() and not torch.compiler.is_exporting() \
        else context.overlap_checker()
    if checker is None:
        return structure
    if op == "set_overlap_for_input":
        return checker.mark_input(structure, mode)
    return checker.mark_output(structure, mode)


def set_overlap_for_input(input_tensors: _Structure, mode: OverlapMode) -> _Structure:
    """Record how host-to-device copies of ``input_tensors`` should overlap compute,
    and return them. A hint only: no effect on CPU/GPU. As in PopTorch, the first call
    of a wrapped model refuses it (``poptorch.Error``) unless ``input_tensors`` are
    inputs of the model's forward that no other op uses (docs/ops.md)."""
    return _set_overlap(input_tensors, mode, "set_overlap_for_input", "input_tensors")


def set_overlap_for_output(output_tensors: _Structure, mode: OverlapMode) -> _Structure:
    """Record how device-to-host copies of ``output_tensors`` should overlap compute,
    and return them. A hint only: no effect on CPU/GPU. As in PopTorch, the first call
    of a wrapped model refuses it (``poptorch.Error``) unless what it returns is
    returned by the model, once (docs/ops.md)."""
    return _set_overlap(output_tensors, mode, "set_overlap_for_output", "output_tensors")
