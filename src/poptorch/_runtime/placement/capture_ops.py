"""The marker operators a ``torch.export`` capture records (``export_capture.py``).

``torch.export`` records ATen operators only: a Python call such as
``recompute.checkpoint_values`` leaves no node. Recomputation checkpoints and the
overlap markers (``set_overlap_for_input`` / ``set_overlap_for_output``) are therefore
called as these two ``torch.library`` operators while a model is exported; the capture
replaces each of their nodes with the node the fx capture makes for the same call
(``checkpoint_values``, ``io_markers.input_marker`` / ``output_marker``), so they never
run. Their kernels return copies only because an operator's outputs may not alias its
inputs.
"""
from __future__ import annotations

import torch

NAMESPACE = "poptorch_capture"


@torch.library.custom_op(f"{NAMESPACE}::checkpoint", mutates_args=())
def checkpoint(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """A recomputation checkpoint of ``tensors`` (replaced once exported)."""
    return [t.clone() for t in tensors]


@checkpoint.register_fake
def _checkpoint_fake(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [torch.empty_like(t) for t in tensors]


@torch.library.custom_op(f"{NAMESPACE}::overlap_marker", mutates_args=())
def overlap_marker(tensor: torch.Tensor, order: int) -> torch.Tensor:
    """The ``order``-th overlap marker of a forward, on ``tensor`` (replaced once
    exported)."""
    return tensor.clone()


@overlap_marker.register_fake
def _overlap_marker_fake(tensor: torch.Tensor, order: int) -> torch.Tensor:
    return torch.empty_like(tensor)


def is_checkpoint(target: object) -> bool:
    """Whether ``target`` (an exported node's) is the checkpoint operator."""
    return target is torch.ops.poptorch_capture.checkpoint.default


def is_overlap_marker(target: object) -> bool:
    """Whether ``target`` (an exported node's) is the overlap marker operator."""
    return target is torch.ops.poptorch_capture.overlap_marker.default
