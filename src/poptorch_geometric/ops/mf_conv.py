"""``MFConv`` that picks each node's degree weights with masks, not index lists."""
from __future__ import annotations

import torch
import torch_geometric
from torch_geometric.typing import Adj, OptPairTensor, Size

__all__ = ["MFConv"]

_STOCK_FORWARD = torch_geometric.nn.MFConv.forward


class MFConv(torch_geometric.nn.MFConv):
    """PyG's ``MFConv`` with a forward pass of fixed shapes for ``edge_index`` tensors.

    Every degree's weights are applied to all nodes and the result kept where the node
    has that degree (clamped to ``max_degree``), where PyG gathers the nodes of each
    degree into a list whose length depends on the graph. Sparse adjacency inputs use
    PyG's forward.
    """

    def forward(self, x: torch.Tensor | OptPairTensor, edge_index: Adj,
                size: Size = None) -> torch.Tensor:
        if not isinstance(edge_index, torch.Tensor) or edge_index.is_sparse or \
                edge_index.layout != torch.strided:
            return _STOCK_FORWARD(self, x, edge_index, size)
        if isinstance(x, torch.Tensor):
            x = (x, x)
        x_root = x[1]
        target = 1 if self.flow == "source_to_target" else 0
        num_nodes = x[0].size(self.node_dim)
        if size is not None:
            num_nodes = size[1]
        if x_root is not None:
            num_nodes = x_root.size(self.node_dim)
        degree = torch.zeros(num_nodes, dtype=torch.long, device=edge_index.device)
        degree = degree.index_add(0, edge_index[target], torch.ones_like(edge_index[target]))
        degree = degree.clamp(max=self.max_degree)

        h = self.propagate(edge_index, x=x, size=size)
        shape = [1] * h.dim()
        shape[self.node_dim] = -1
        out = h.new_zeros([*h.shape[:-1], self.out_channels])
        for value, (lin_l, lin_r) in enumerate(zip(self.lins_l, self.lins_r, strict=True)):
            mask = (degree == value).view(shape)
            result = lin_l(torch.where(mask, h, 0.0))
            if x_root is not None:
                result = result + lin_r(torch.where(mask, x_root, 0.0))
            out = torch.where(mask, result, out)
        return out
