"""The aggregation base with a sortedness check that compiles to a static graph."""
from __future__ import annotations

import torch
import torch_geometric

__all__ = ["Aggregation"]


class Aggregation(torch_geometric.nn.aggr.Aggregation):
    """PyG's ``Aggregation`` whose ``assert_sorted_index`` suits compiled programs.

    Run eagerly, the check is PyG's: aggregations that need ``index`` sorted (LSTM,
    GRU, sort, set transformer, ...) raise ``ValueError`` on an unsorted one. While
    ``torch.compile`` captures the model, the check is left out: it would read the
    index back to the host and split the program (PopTorch leaves it out on the IPU
    for the same reason).
    """

    def assert_sorted_index(self, index: torch.Tensor | None) -> None:
        if index is None or index.numel() < 2 or torch.compiler.is_compiling():
            return
        if bool((index[1:] < index[:-1]).any()):
            raise ValueError(
                f"{type(self).__name__}: the 'index' tensor must be sorted for this "
                "aggregation. As part of MessagePassing, sort 'edge_index' by destination "
                "node, e.g. with data.sort(sort_by_row=False).")
