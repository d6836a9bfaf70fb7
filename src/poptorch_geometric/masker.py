"""Maskers: the model side of padding, decoupled from the loader that pads.

A loader that pads batches knows which nodes, edges and graphs are padding; a model
that must ignore them (before a loss, before pooling) calls a :class:`Masker`'s
``node_masker`` / ``edge_masker`` / ``graph_masker`` between its layers, or wraps a
layer with a :class:`LayerMasker`. :class:`NoMasker` is the no-op for data without
padding, so the same model runs with either kind of loader. The maskers run inside the
model: they must be traceable (plain tensor operations).
"""
from __future__ import annotations

import abc
from collections.abc import Callable
from typing import Any

import torch

__all__ = [
    "DecoratedLayer",
    "Entries",
    "Layer",
    "LayerMasker",
    "Mask",
    "Masker",
    "NoMasker",
    "PreLayerMasker",
]

Entries = torch.Tensor | tuple[torch.Tensor, ...]
Mask = torch.Tensor | None
Layer = Callable[..., Any]
DecoratedLayer = Callable[..., Any]


class Masker(abc.ABC):
    """Masks the entries of nodes, edges or graphs that batching added (padding)."""

    @abc.abstractmethod
    def node_masker(self, node_entries: Entries, mask: Mask = None) -> Entries:
        """``node_entries`` with the padding nodes masked out."""

    @abc.abstractmethod
    def edge_masker(self, edge_entries: Entries, mask: Mask = None) -> Entries:
        """``edge_entries`` with the padding edges masked out."""

    @abc.abstractmethod
    def graph_masker(self, graph_entries: Entries, mask: Mask = None) -> Entries:
        """``graph_entries`` with the padding graphs masked out."""


class NoMasker(Masker):
    """The masker of data without padding: returns its entries unchanged."""

    def node_masker(self, node_entries: Entries, mask: Mask = None) -> Entries:
        return node_entries

    def edge_masker(self, edge_entries: Entries, mask: Mask = None) -> Entries:
        return edge_entries

    def graph_masker(self, graph_entries: Entries, mask: Mask = None) -> Entries:
        return graph_entries


class LayerMasker(abc.ABC):
    """Wraps layers so that their inputs pass through a :class:`Masker` first.

    Wrapping the layers built in a module's ``__init__`` masks them without changing
    its ``forward``. The wrapped layer takes its tensors positionally and the mask as
    the keyword ``mask``; every tensor is masked at the same level (node, edge or
    graph), so a layer that mixes levels needs its own masking.
    """

    def __init__(self, masker: Masker) -> None:
        super().__init__()
        self.masker = masker

    @abc.abstractmethod
    def node_masker(self, layer: Layer) -> DecoratedLayer:
        """``layer`` with its node-level inputs masked."""
        return self._wrap(layer, self.masker.node_masker)

    @abc.abstractmethod
    def edge_masker(self, layer: Layer) -> DecoratedLayer:
        """``layer`` with its edge-level inputs masked."""
        return self._wrap(layer, self.masker.edge_masker)

    @abc.abstractmethod
    def graph_masker(self, layer: Layer) -> DecoratedLayer:
        """``layer`` with its graph-level inputs masked."""
        return self._wrap(layer, self.masker.graph_masker)

    @staticmethod
    def _wrap(layer: Layer, mask_entries: Callable[..., Entries]) -> DecoratedLayer:
        def masked_layer(*args: torch.Tensor, mask: Mask = None) -> Any:
            return layer(*mask_entries(args, mask=mask))

        return masked_layer


class PreLayerMasker(LayerMasker):
    """The :class:`LayerMasker` that masks a layer's inputs before it runs."""

    def node_masker(self, layer: Layer) -> DecoratedLayer:
        return super().node_masker(layer)

    def edge_masker(self, layer: Layer) -> DecoratedLayer:
        return super().edge_masker(layer)

    def graph_masker(self, layer: Layer) -> DecoratedLayer:
        return super().graph_masker(layer)
