"""One-pass batching of plain ``Data`` graphs with their padding, for the fixed-size
collater.

``Batch.from_data_list`` on the real graphs plus padding graphs counts every graph's
nodes again, builds each padding graph as a ``Data`` object, and shifts node indices
graph by graph. The collater has already measured the graphs, so here each attribute
is concatenated once (real values, then the padding rows), node indices are shifted by
one vectorised add, and the batch vector, slices and increments come from the measured
counts. The result is the ``Batch`` that ``Batch.from_data_list`` gives for the same
graphs (same tensors, ``_slice_dict``, ``_inc_dict`` and key order).

Only graphs of PyG's own ``Data`` class (whose ``__cat_dim__`` / ``__inc__`` rules are
known) with dense CPU tensors and plain Python values qualify; :func:`padded_batch`
returns None for anything else and the collater batches with PyG.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.utils.data
from torch_geometric.data import Batch, Data
from torch_geometric.data.data import BaseData
from torch_geometric.utils import cumsum

from .fixed_size_options import FixedSizeOptions
from .levels import Infos
from .padding import padded_value

__all__ = ["padded_batch"]

_INTEGERS = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


def padded_batch(data_list: Sequence[BaseData], real_nodes: Sequence[int],
                 pad_nodes: Sequence[int], pad_edges: Sequence[int], infos: Infos,
                 options: FixedSizeOptions, follow_batch: Sequence[str],
                 exclude_keys: Sequence[str]) -> Batch | None:
    """The batch of ``data_list`` (``real_nodes`` nodes each) followed by padding graphs
    of ``pad_nodes`` nodes and ``pad_edges`` edges each, as ``Batch.from_data_list``
    makes it of the graphs and their padding graphs; None when the graphs do not
    qualify for this path (see the module's docstring)."""
    first = data_list[0]
    if type(first) is not Data:
        return None
    store = first.stores[0]
    keys = [key for key in store if key not in exclude_keys]
    if not all(_plain(key, store[key]) for key in keys):
        return None
    counts = [*real_nodes, *pad_nodes]
    num_graphs = len(counts)
    stores = [data.stores[0] for data in data_list]
    out = Batch(_base_cls=Data)
    out.stores_as(first)
    out_store = out.stores[0]
    slice_dict: dict[str, Any] = {}
    inc_dict: dict[str, Any] = {}
    node_offsets: torch.Tensor | None = None
    zeros: torch.Tensor | None = None
    for key in keys:
        if key == "ptr":  # PyG leaves a graph's own ``ptr`` out of the batch
            continue
        template = store[key]
        info = infos[(0, key)]
        values = [s[key] for s in stores] + [
            padded_value(key, template, info, nodes, edges, options)
            for nodes, edges in zip(pad_nodes, pad_edges, strict=True)]
        increments = _shifts_node_indices(key)
        if increments and node_offsets is None:
            node_offsets = cumsum(torch.tensor(counts[:-1], dtype=torch.long))
        value: Any
        if isinstance(template, torch.Tensor):
            value, sizes = _concatenated(key, values, first,
                                         node_offsets if increments else None)
        else:
            value = torch.tensor(values) if _number(template) else values
            sizes = [1] * num_graphs
        size_tensor = torch.tensor(sizes)
        slices = cumsum(size_tensor)
        if increments:
            assert node_offsets is not None
            inc_dict[key] = node_offsets
        elif isinstance(template, torch.Tensor) or _number(template):
            if zeros is None:
                zeros = torch.zeros(num_graphs, dtype=torch.long)
            inc_dict[key] = zeros
        else:
            inc_dict[key] = None
        out_store[key] = value
        slice_dict[key] = slices
        if key in follow_batch:
            out_store[f"{key}_batch"] = _batch_vector(size_tensor)
            out_store[f"{key}_ptr"] = slices.clone()
    if store.can_infer_num_nodes:
        count_tensor = torch.tensor(counts)
        out_store.batch = _batch_vector(count_tensor)
        out_store.ptr = cumsum(count_tensor)
    out._num_graphs = num_graphs
    out._slice_dict = slice_dict
    out._inc_dict = inc_dict
    return out


def _plain(key: str, value: Any) -> bool:
    """Whether this path batches ``key`` as PyG would: a dense CPU tensor (of a real
    number type when it holds node indices: shifted in place, the dtype stays), or a
    plain Python value, whose increments are node counts or zero."""
    if key == "num_nodes" or "batch" in key:
        return False  # PyG sums explicit counts and increments batch vectors by max + 1
    if isinstance(value, torch.Tensor):
        return (type(value) is torch.Tensor and value.layout == torch.strided
                and not value.is_nested and value.device.type == "cpu"
                and (not _shifts_node_indices(key) or value.is_floating_point()
                     or value.dtype in _INTEGERS))
    if isinstance(value, Mapping):
        return False  # PyG batches each entry
    if _number(value):
        return not _shifts_node_indices(key)
    if isinstance(value, Sequence) and not isinstance(value, str) and value:
        return not _special(value[0])  # PyG batches lists of tensors entry by entry
    return not _special(value)


def _special(value: Any) -> bool:
    """Tensors, and the sparse tensors and tensor frames PyG batches in their own way."""
    return isinstance(value, torch.Tensor) or \
        type(value).__module__.split(".")[0] in ("torch_sparse", "torch_frame")


def _number(value: Any) -> bool:
    return isinstance(value, int | float)


def _shifts_node_indices(key: str) -> bool:
    """``Data.__inc__``: node indices (``*index*``, ``face``) are shifted by the number
    of nodes of the graphs before."""
    return "index" in key or key == "face"


def _concatenated(key: str, values: list[torch.Tensor], first: Data,
                  node_offsets: torch.Tensor | None) -> tuple[torch.Tensor, list[int]]:
    """``values`` joined along their ``__cat_dim__`` (stacked when 0-dimensional), node
    indices shifted by ``node_offsets`` (one per graph); and each value's size along
    that dimension."""
    template = values[0]
    if template.dim() == 0:
        dim, sizes = 0, [1] * len(values)
        joined = _joined(values, 0, stack=True)
    else:
        dim = first.__cat_dim__(key, template)
        sizes = [value.shape[dim] for value in values]
        joined = _joined(values, dim, stack=False)
    if node_offsets is not None and int(node_offsets[-1]) != 0:
        shift = node_offsets.repeat_interleave(torch.tensor(sizes))
        axis = dim % joined.dim()
        joined.add_(shift.view([-1] + [1] * (joined.dim() - axis - 1)))
    return joined, sizes


def _joined(values: list[torch.Tensor], dim: int, stack: bool) -> torch.Tensor:
    """``torch.cat`` / ``torch.stack``; in a data loader's worker process written into
    shared memory, as the batch will travel to the main process."""
    join: Callable[..., torch.Tensor] = torch.stack if stack else torch.cat
    if torch.utils.data.get_worker_info() is None:
        return join(values, dim)
    shape = list(values[0].shape)
    if stack:
        shape.insert(0, len(values))
    else:
        shape[dim] = sum(value.shape[dim] for value in values)
    out = torch.empty(shape, dtype=_promoted([value.dtype for value in values]))
    out.share_memory_()
    return join(values, dim, out=out)


def _promoted(dtypes: list[torch.dtype]) -> torch.dtype:
    result = dtypes[0]
    for dtype in dtypes[1:]:
        result = torch.promote_types(result, dtype)
    return result


def _batch_vector(sizes: torch.Tensor) -> torch.Tensor:
    """Graph ``i`` repeated ``sizes[i]`` times."""
    return torch.arange(sizes.numel()).repeat_interleave(sizes)
