"""``ClusterGCNConv`` whose edge weights have a static shape."""
from __future__ import annotations

from typing import cast

import torch
import torch_geometric
from torch_geometric.typing import Adj

__all__ = ["ClusterGCNConv"]

_STOCK_FORWARD = torch_geometric.nn.ClusterGCNConv.forward


class ClusterGCNConv(torch_geometric.nn.ClusterGCNConv):
    """PyG's ``ClusterGCNConv`` with a forward pass of fixed shapes for ``edge_index``
    tensors: ``(A + I) D^-1`` weights plus ``diag_lambda`` on the diagonal, computed
    without removing edges (a self-loop already in the graph gets weight 0 when
    ``add_self_loops`` adds a fresh one). Sparse adjacency inputs use PyG's forward.
    """

    def forward(self, x: torch.Tensor, edge_index: Adj) -> torch.Tensor:
        if not isinstance(edge_index, torch.Tensor) or edge_index.is_sparse or \
                edge_index.layout != torch.strided:
            return _STOCK_FORWARD(self, x, edge_index)
        num_nodes = x.shape[cast(int, self.node_dim)]
        row, col = edge_index[0], edge_index[1]
        keep = torch.ones(row.shape[0], dtype=x.dtype, device=x.device)
        if self.add_self_loops:
            keep = (row != col).to(x.dtype)  # replaced by the loops added below
            loops = torch.arange(num_nodes, dtype=row.dtype, device=row.device)
            row, col = torch.cat([row, loops]), torch.cat([col, loops])
            keep = torch.cat([keep, keep.new_ones(num_nodes)])
            edge_index = torch.stack([row, col], dim=0)
        degree = torch.zeros(num_nodes, dtype=x.dtype, device=x.device)
        degree = degree.index_add(0, col, keep)
        deg_inv = 1.0 / degree.clamp(min=1.0)
        on_diagonal = (row == col).to(x.dtype)
        edge_weight = keep * (deg_inv[col] + self.diag_lambda * deg_inv[row] * on_diagonal)
        out = self.propagate(edge_index, x=x, edge_weight=edge_weight)
        return self.lin_out(out) + self.lin_root(x)
