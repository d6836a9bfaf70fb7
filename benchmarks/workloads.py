"""The models the benchmarks run, defined once (bench_compiled.py, bench_executor.py),
and the live-tensor count the memory benchmarks share (bench_memory.py,
gpu_memory_check.py).

Each takes ``(x, y)`` and returns ``(output, loss)``. ``WORKLOADS`` names the four
workloads of issue 14 with their micro-batch size and input makers.
"""
from __future__ import annotations

import gc
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = [
    "CNN",
    "GPT",
    "MLP",
    "WORKLOADS",
    "Tiny",
    "TinyMLP",
    "classes",
    "live_tensor_bytes",
]


class Tiny(nn.Module):
    """Overhead-bound: one Linear 32->10."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(32, 10)

    def forward(self, x, y):
        out = self.fc(x)
        return out, F.cross_entropy(out, y)


class TinyMLP(nn.Module):
    """Overhead-bound: 32-32-10."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(32, 32), nn.Linear(32, 10)

    def forward(self, x, y):
        out = self.fc2(F.relu(self.fc1(x)))
        return out, F.cross_entropy(out, y)


class MLP(nn.Module):
    """784-512-512-10."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512),
                                 nn.ReLU(), nn.Linear(512, 10))

    def forward(self, x, y):
        out = self.net(x)
        return out, F.cross_entropy(out, y)


class CNN(nn.Module):
    """Small CNN on 1x28x28 images."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc = nn.Linear(32 * 7 * 7, 10)

    def forward(self, x, y):
        h = F.max_pool2d(F.relu(self.conv1(x)), 2)
        h = F.max_pool2d(F.relu(self.conv2(h)), 2)
        out = self.fc(h.flatten(1))
        return out, F.cross_entropy(out, y)


class GPT(nn.Module):
    """Small causal transformer: 2 layers, width 64, 4 heads, context 32, vocab 128."""

    def __init__(self, vocab=128, width=64, heads=4, layers=2, context=32):
        super().__init__()
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Parameter(torch.zeros(context, width))
        self.layers = nn.ModuleList(_Layer(width, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)

    def forward(self, x, y):
        h = self.tok(x) + self.pos[:x.shape[1]]
        for layer in self.layers:
            h = layer(h)
        logits = self.head(self.norm(h))
        return logits, F.cross_entropy(logits.flatten(0, 1), y.flatten())


class _Layer(nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(),
                                 nn.Linear(4 * width, width))

    def forward(self, h):
        b, t, c = h.shape
        q, k, v = self.qkv(self.norm1(h)).view(b, t, 3, self.heads, c // self.heads) \
            .permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = h + self.proj(a.transpose(1, 2).reshape(b, t, c))
        return h + self.mlp(self.norm2(h))


def classes(count: int):
    """A maker of ``n`` random class labels in ``[0, count)``."""
    return lambda n, g: torch.randint(0, count, (n,), generator=g)


def _images(n, g):
    return torch.randn(n, 1, 28, 28, generator=g)


WORKLOADS = {
    # name: (model class, micro-batch, make x(n, generator), make y(n, generator))
    "tiny": (TinyMLP, 16, lambda n, g: torch.randn(n, 32, generator=g), classes(10)),
    "mlp": (MLP, 64, lambda n, g: torch.randn(n, 784, generator=g), classes(10)),
    "cnn": (CNN, 32, _images, classes(10)),
    "gpt": (GPT, 8, lambda n, g: torch.randint(0, 128, (n, 32), generator=g),
            lambda n, g: torch.randint(0, 128, (n, 32), generator=g)),
}


def live_tensor_bytes() -> int:
    """Bytes of every live tensor's storage, each storage once (a DTensor by its local
    shard): what a process holds in tensors, counted with ``gc``."""
    from torch.distributed.tensor import DTensor
    gc.collect()
    seen: set[int] = set()
    total = 0
    with warnings.catch_warnings():  # (isinstance on torch's deprecated module attributes)
        warnings.simplefilter("ignore")
        objects = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
    for obj in objects:
        t = obj.to_local() if isinstance(obj, DTensor) else obj
        try:  # (fake tensors of a captured graph's metadata hold no memory)
            storage = t.untyped_storage()
            pointer = storage.data_ptr()
        except (RuntimeError, NotImplementedError):
            continue
        if pointer not in seen and storage.nbytes():
            seen.add(pointer)
            total += storage.nbytes()
    return total
