"""``HeteroLinear`` that applies each type's weights with masks, not sorted segments."""
from __future__ import annotations

import torch
import torch_geometric

__all__ = ["HeteroLinear"]


class HeteroLinear(torch_geometric.nn.HeteroLinear):
    """PyG's ``HeteroLinear`` with a forward pass of fixed shapes.

    Each type's weight matrix is applied to all rows and the result kept where the row
    has that type, where PyG sorts the rows by type and multiplies segments whose
    lengths depend on the data. ``type_vec`` need not be sorted. Run eagerly, a type
    outside ``[0, num_types)`` raises ``ValueError``; while ``torch.compile`` captures
    the model that check is left out (it would read ``type_vec`` back to the host).
    """

    def forward(self, x: torch.Tensor, type_vec: torch.Tensor) -> torch.Tensor:
        if not torch.compiler.is_compiling() and type_vec.numel() > 0 and \
                bool(((type_vec < 0) | (type_vec >= self.num_types)).any()):
            raise ValueError(f"HeteroLinear: type_vec holds types outside [0, "
                             f"{self.num_types}) (num_types={self.num_types}).")
        out = x.new_zeros(*x.shape[:-1], self.out_channels)
        for type_index in range(self.num_types):
            mask = (type_vec == type_index).unsqueeze(-1)
            result = torch.where(mask, x, 0.0) @ self.weight[type_index]
            out = torch.where(mask, result, out)
        if self.bias is not None:
            out = out + self.bias[type_vec]
        return out
