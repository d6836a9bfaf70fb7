"""Group norm with strided channel groups: ``opts._Popart.set(
"groupNormStridedChannelGrouping", True)``.

PopART's option puts channel ``k`` of ``C`` into group ``k % G`` (channels ``g, g + G,
g + 2G, ...`` form group ``g``) instead of PyTorch's ``k // (C / G)`` (consecutive
channels). The mean and variance of a group are taken over its channels and the other
non-batch dimensions, as usual; the affine weight and bias stay per channel. The result
differs from ``torch.nn.GroupNorm`` whenever ``1 < G < C``, so the option must act.

How: the channels are reordered so that every strided group is consecutive, PyTorch's
own ``group_norm`` normalises them, the order is restored and the per-channel affine
applied; autograd flows through every step. A torch function mode catches
``F.group_norm`` / ``torch.group_norm`` (what ``nn.GroupNorm`` calls) while the model
runs; it is installed only when the option is on, so other models pay nothing.
"""
from __future__ import annotations

from collections.abc import Callable, Collection

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

OPTION = "groupNormStridedChannelGrouping"


def strided_group_norm(input: torch.Tensor, num_groups: int,
                       weight: torch.Tensor | None = None,
                       bias: torch.Tensor | None = None,
                       eps: float = 1e-5) -> torch.Tensor:
    """``F.group_norm`` where group ``g`` holds channels ``g, g + G, g + 2G, ...``."""
    channels = input.shape[1] if input.dim() > 1 else 0
    if input.dim() < 2 or num_groups <= 0 or channels % num_groups:
        # PyTorch's own checks and messages for shapes it refuses
        return F.group_norm(input, num_groups, weight, bias, eps)
    per_group = channels // num_groups
    # [N, C, *] -> [N, C/G, G, *] -> [N, G, C/G, *]: channel g + j*G lands in group g
    grouped = input.unflatten(1, (per_group, num_groups)).transpose(1, 2).flatten(1, 2)
    normed = F.group_norm(grouped, num_groups, eps=eps)
    out = normed.unflatten(1, (num_groups, per_group)).transpose(1, 2).flatten(1, 2)
    shape = (1, channels) + (1,) * (input.dim() - 2)
    if weight is not None:
        out = out * weight.reshape(shape)
    if bias is not None:
        out = out + bias.reshape(shape)
    return out


def _torch_group_norm(input: torch.Tensor, num_groups: int,
                      weight: torch.Tensor | None = None,
                      bias: torch.Tensor | None = None, eps: float = 1e-5,
                      cudnn_enabled: bool = True) -> torch.Tensor:
    return strided_group_norm(input, num_groups, weight, bias, eps)


_REPLACEMENTS: dict[Callable[..., object], Callable[..., torch.Tensor]] = {
    F.group_norm: strided_group_norm, torch.group_norm: _torch_group_norm}


class StridedGroupNorm(TorchFunctionMode):
    """A device-program wrapper (a torch function mode entered around each call): group
    norms use strided channel groups. Modes do not follow a call into other threads, so
    pipeline stages' threads get their own through :py:meth:`thread_context`."""

    def __torch_function__(self, func: Callable[..., object], types: Collection[type],
                           args: tuple[object, ...] = (),
                           kwargs: dict[str, object] | None = None) -> object:
        replacement = _REPLACEMENTS.get(func)
        if replacement is not None:
            return replacement(*args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))

    def thread_context(self) -> StridedGroupNorm:
        return StridedGroupNorm()


def wanted(popart_options: dict) -> bool:
    """True if the PopART options ask for strided channel groups."""
    return bool(popart_options.get(OPTION, False))
