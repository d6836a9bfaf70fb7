"""``InstanceNorm`` over the graphs of a batch, with statistics of fixed shape."""
from __future__ import annotations

import torch
import torch_geometric

__all__ = ["InstanceNorm"]

_STOCK_FORWARD = torch_geometric.nn.InstanceNorm.forward


class InstanceNorm(torch_geometric.nn.InstanceNorm):
    """PyG's ``InstanceNorm`` whose per-graph statistics are sums into ``batch_size``
    rows, and whose running statistics are updated in place (outside autograd), so the
    buffers keep their identity inside a compiled program.

    Pass ``batch_size`` inside a compiled model: without it the number of graphs is
    read from ``batch`` (``batch.max() + 1``), a value that depends on the data. The
    mean and variance follow PyG: biased variance for normalising, unbiased (``n - 1``,
    at least 1) for the running variance.
    """

    def forward(self, x: torch.Tensor, batch: torch.Tensor | None = None,
                batch_size: int | None = None) -> torch.Tensor:
        if batch is None:
            return _STOCK_FORWARD(self, x, batch, batch_size)
        if batch_size is None:
            batch_size = int(batch.max()) + 1
        batch = batch.long()
        if self.training or not self.track_running_stats:
            count = torch.zeros(batch_size, 1, dtype=x.dtype, device=x.device)
            count = count.index_add(0, batch, torch.ones_like(x[:, :1]))
            norm = count.clamp(min=1.0)
            summed = torch.zeros(batch_size, x.shape[1], dtype=x.dtype, device=x.device)
            mean = summed.index_add(0, batch, x) / norm
            centred = x - mean[batch]
            squares = torch.zeros_like(summed).index_add(0, batch, centred * centred)
            var = squares / norm
            _update_running_stats(self, mean, squares / (count - 1.0).clamp(min=1.0))
        else:
            mean = self.running_mean.view(1, -1).expand(batch_size, -1)
            var = self.running_var.view(1, -1).expand(batch_size, -1)
            centred = x - mean[batch]
        out = centred / (var + self.eps).sqrt()[batch]
        if self.weight is not None and self.bias is not None:
            out = out * self.weight.view(1, -1) + self.bias.view(1, -1)
        return out


def _update_running_stats(norm: torch_geometric.nn.InstanceNorm, mean: torch.Tensor,
                          unbiased_var: torch.Tensor) -> None:
    """PyG's momentum update of the running statistics, in place and without autograd
    (a function, not a method: the forward above also runs on PyG's own class)."""
    momentum = float(norm.momentum)  # None: PyG's own update fails too
    with torch.no_grad():
        if norm.running_mean is not None:
            norm.running_mean.mul_(1.0 - momentum).add_(mean.mean(0), alpha=momentum)
        if norm.running_var is not None:
            norm.running_var.mul_(1.0 - momentum).add_(unbiased_var.mean(0), alpha=momentum)
