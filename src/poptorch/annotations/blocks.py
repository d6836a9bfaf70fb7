"""Model-parallel annotations: blocks, and recomputation checkpoints.

A model is divided into *blocks* with :py:class:`BeginBlock` (on an existing layer),
:py:class:`Block` (a context manager inside ``forward``) or :py:func:`BlockFunction`
(a decorator). Blocks are grouped into stages and phases by an execution strategy
(:py:mod:`poptorch.annotations.strategies`).

The annotations do nothing by themselves: they report block boundaries to the
*block listener* of the current thread (``poptorch._runtime.placement.markers``), which
the model-parallel runtime installs while it runs the model. Outside a PopTorch executor
an annotated model therefore behaves exactly like the plain model.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from types import TracebackType
from typing import Any, NoReturn

import torch

from .._runtime.placement import markers, recompute
from .._typing import UserInput, UserOutput
from ..errors import Error, PoptorchAssertionError, PoptorchTypeError, PoptorchValueError

__all__ = [
    "IPU",
    "BeginBlock",
    "Block",
    "BlockFunction",
    "LegacyBeginBlockFn",
    "begin_block_of",
    "recomputationCheckpoint",
    "removeBlocks",
]

class BlockArgumentError(PoptorchAssertionError, TypeError):
    """``removeBlocks`` given something that is no module: upstream's ``assert``
    (``AssertionError``), a ``poptorch.Error``, and the ``TypeError`` that earlier
    OpenPopTorch releases raised."""


class CheckpointArgumentError(PoptorchValueError, TypeError):
    """``recomputationCheckpoint`` given something that is no tensor: upstream's
    ``ValueError``, a ``poptorch.Error``, and the ``TypeError`` that earlier OpenPopTorch
    releases raised."""


def _check_id(name: str, value: object, kinds: tuple) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, kinds)):
        allowed = " or ".join(k.__name__ for k in kinds)
        raise PoptorchTypeError(
            f"{name} must be None or a {allowed}, not {type(value).__name__} ({value!r})")


def _check_block_args(user_id: str | int | None, ipu_id: int | None) -> None:
    _check_id("user_id", user_id, (str, int))
    _check_id("ipu_id", ipu_id, (int, ))
    if ipu_id is not None and ipu_id < 0:
        raise PoptorchValueError(f"ipu_id must be >= 0, got {ipu_id}")


class Block(torch.nn.Module):
    """A context manager defining a block of the model inside ``forward``.

    >>> with poptorch.Block("Encoder", ipu_id=0):
    ...     x = self.encoder(x)

    Everything called inside the scope (and after it, until the next block starts)
    runs in the block. Blocks with the same ``user_id`` form a single block.

    :param user_id: identifier of the block, used by :py:class:`Stage` and
        :py:class:`Phase` (``str`` or ``int``; ints are converted to strings).
        ``None``: an automatic id, the index of the block among the id-less blocks.
    :param ipu_id: the IPU the block runs on (unless a :py:class:`Stage` says otherwise).
    """

    def __init__(self, user_id: str | int | None = None, ipu_id: int | None = None) -> None:
        super().__init__()
        _check_block_args(user_id, ipu_id)
        self._user_id = user_id
        self._ipu_id = ipu_id

    @staticmethod
    def useAutoId() -> None:
        """Restart the automatic ids of id-less blocks at ``"0"``.

        Call it at the start of ``forward``. (PopTorch numbers id-less blocks from 0 at
        every forward pass anyway; calling it again part way through restarts the count.)
        """
        listener = markers.current_listener()
        if listener is not None:
            listener.reset_auto_id()

    @staticmethod
    def start(user_id: str | int | None = None, ipu_id: int | None = None) -> None:
        """Start a block here: everything run from now on belongs to it."""
        _check_block_args(user_id, ipu_id)
        markers.begin_block(user_id, ipu_id)

    def __enter__(self) -> Block:
        Block.start(self._user_id, self._ipu_id)
        return self

    def __exit__(self, type: type[BaseException] | None, value: BaseException | None,
                 traceback: TracebackType | None) -> None:
        # Code after the scope stays in this block until the next block starts
        # (as for BeginBlock); nothing to undo.
        return None

    def extra_repr(self) -> str:
        return f"user_id={self._user_id!r}, ipu_id={self._ipu_id!r}"


def BeginBlock(layer_to_call: torch.nn.Module | Callable[..., UserOutput],
               user_id: str | int | None = None, ipu_id: int | None = None
               ) -> torch.nn.Module:
    """Start a block at an existing layer: the layer and everything called after it
    belong to the block (until the next block starts).

    >>> poptorch.BeginBlock(model.layer2, ipu_id=1)

    The layer is annotated in place (with a forward pre-hook) and returned, so
    ``self.layer = poptorch.BeginBlock(Layer(), ipu_id=1)`` works too. A plain function
    is wrapped in a :py:class:`LegacyBeginBlockFn` module (PopTorch's legacy use).
    :py:func:`removeBlocks` removes the annotation.
    """
    if not isinstance(layer_to_call, torch.nn.Module):
        if callable(layer_to_call):
            # PopTorch's legacy form: a function is wrapped in a module that starts
            # the block each time it is called.
            return LegacyBeginBlockFn(layer_to_call, user_id, ipu_id)
        raise Error("BeginBlock can only annotate a torch.nn.Module or wrap a "
                    f"function; got {type(layer_to_call).__name__}. Use poptorch.Block "
                    "(a context manager) or poptorch.BlockFunction (a decorator) for "
                    "other code.")
    _check_block_args(user_id, ipu_id)
    markers.attach_begin_block(layer_to_call, user_id, ipu_id)
    return layer_to_call


class LegacyBeginBlockFn(torch.nn.Module):
    """A module wrapping ``layer_to_call`` that starts a block each time it is called.

    (The wrapper form of :py:func:`BeginBlock` of earlier PopTorch releases.)
    """
    _poptorch_starts_block = True  # markers.STARTS_BLOCK_ATTR

    def __init__(self, layer_to_call: Callable[..., UserOutput], user_id: str | int | None = None,
                 ipu_id: int | None = None) -> None:
        super().__init__()
        _check_block_args(user_id, ipu_id)
        if not callable(layer_to_call):
            raise PoptorchTypeError("layer_to_call must be callable, got "
                            f"{type(layer_to_call).__name__}")
        self._user_id = user_id
        self._ipu_id = ipu_id
        self._layer_to_call = layer_to_call

    def __call__(self, *input: UserInput, **kwargs: UserInput) -> UserOutput:
        Block.start(self._user_id, self._ipu_id)
        return self._layer_to_call(*input, **kwargs)

    forward = __call__


class IPU(LegacyBeginBlockFn):
    """The pipeline annotator of PopTorch 1.0: ``IPU(ipu_id, layer_to_call=None)``.

    With a layer, it wraps the layer so that the layer and everything after it runs on
    IPU ``ipu_id``. Without a layer, use it as a context manager, like
    :py:class:`Block` ``(ipu_id=ipu_id)``.
    """

    def __init__(self, ipu_id: int, layer_to_call: Callable[..., UserOutput] | None = None
                 ) -> None:
        if isinstance(ipu_id, bool) or not isinstance(ipu_id, int):
            raise PoptorchTypeError(f"ipu_id must be an int, got {type(ipu_id).__name__}")
        super().__init__(layer_to_call if layer_to_call is not None else _no_layer,
                         None, ipu_id)
        self._has_layer = layer_to_call is not None

    def __call__(self, *input: UserInput, **kwargs: UserInput) -> UserOutput:
        if not self._has_layer:
            raise Error("poptorch.IPU(ipu_id) without a layer is a context manager: use "
                        "'with poptorch.IPU(1): ...' or pass the layer to wrap.")
        return super().__call__(*input, **kwargs)

    forward = __call__

    def __enter__(self) -> IPU:
        Block.start(None, self._ipu_id)
        return self

    def __exit__(self, type: type[BaseException] | None, value: BaseException | None,
                 traceback: TracebackType | None) -> None:
        return None


def _no_layer(*args: object, **kwargs: object) -> NoReturn:
    """The layer of an IPU used as a context manager (never called)."""
    raise Error("poptorch.IPU has no layer to call")


def BlockFunction(user_id: str | int | None = None, ipu_id: int | None = None
                  ) -> Callable[[Callable], Callable]:
    """A decorator running a function in a block.

    >>> @poptorch.BlockFunction("Decoder", ipu_id=1)
    ... def decoder(self, encoder_output):
    ...     return self.decoder_b1(encoder_output)
    """
    _check_block_args(user_id, ipu_id)

    def decorator(func: Callable) -> Callable:
        if not callable(func):
            raise PoptorchTypeError(
                f"BlockFunction decorates functions, got {type(func).__name__}")

        @functools.wraps(func)
        def wrapper(*args: UserInput, **kwargs: UserInput) -> UserOutput:
            Block.start(user_id, ipu_id)
            return func(*args, **kwargs)

        wrapper._poptorch_block_function = (user_id, ipu_id)  # type: ignore[attr-defined]  # (a function attribute, read by IPU)
        return wrapper

    return decorator


def removeBlocks(module: torch.nn.Module) -> None:
    """Recursively remove :py:func:`BeginBlock` annotations from ``module``."""
    if not isinstance(module, torch.nn.Module):
        raise BlockArgumentError(
            f"removeBlocks expects a torch.nn.Module, got {type(module).__name__}")
    for sub in module.modules():
        markers.detach_begin_block(sub)


def recomputationCheckpoint(*tensors: torch.Tensor | list | tuple
                            ) -> torch.Tensor | tuple | list:
    """Checkpoint ``tensors``: with recomputation enabled they are kept in memory between
    the forward and backward passes, and the activations computed between two
    checkpoints are recomputed in the backward pass instead of being stored.

    :return: tensors of the same number and shape (a single tensor when one is given,
        a tuple otherwise, or a list when given one list/tuple).
    """
    as_list = len(tensors) == 1 and isinstance(tensors[0], (list, tuple))
    # (tensors, or fx Proxies while a model is captured)
    flat: list[Any] = list(tensors[0]) if as_list else list(tensors)
    for t in flat:
        if not isinstance(t, (torch.Tensor, torch.fx.Proxy)):  # (Proxy: graph capture)
            raise CheckpointArgumentError("recomputationCheckpoint expects tensors, got "
                            f"{type(t).__name__}")
    listener = markers.current_listener()
    if listener is not None:
        flat = listener.checkpoint(flat)
    flat = recompute.checkpoint(flat)
    if as_list:
        return type(tensors[0])(flat) if isinstance(tensors[0], tuple) else flat
    return flat[0] if len(flat) == 1 else tuple(flat)


begin_block_of = markers.begin_block_of
