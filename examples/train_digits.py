"""Train a small CNN on scikit-learn's 8x8 handwritten digits through the PopTorch API.

The data set ships inside scikit-learn (no download). Training runs on the CPU "IPU
Model" by default: ``poptorch.DataLoader`` feeds combined batches, ``trainingModel``
runs ``deviceIterations`` optimizer steps per call, and an ``inferenceModel`` of the same
module (weights shared, no copies) measures test accuracy after every epoch.

Run: ``python examples/train_digits.py [--epochs N] [--target ACC]``, or on several
processes unchanged: ``torchrun --nproc_per_node=2 examples/train_digits.py`` (each
process reads its share of the data; gradients are summed over the processes).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.datasets import load_digits
from tqdm import tqdm

import poptorch


class DigitsCNN(nn.Module):
    """Two conv layers and a classifier; returns (logits, loss) when given labels."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(16)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc = nn.Linear(32 * 2 * 2, 10)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None):
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        logits = self.fc(x.flatten(1))
        if labels is None:
            return logits
        return logits, F.cross_entropy(logits, labels)


def load_data(seed: int):
    """Digits as (N, 1, 8, 8) float tensors in [0, 1], split 75% / 25%."""
    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(digits.target, dtype=torch.long)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    cut = int(0.75 * len(labels))
    train, test = order[:cut], order[cut:]
    return (torch.utils.data.TensorDataset(images[train], labels[train]),
            torch.utils.data.TensorDataset(images[test], labels[test]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--target", type=float, default=0.95,
                        help="test accuracy the run must reach (exit status 1 if not)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    torch.manual_seed(args.seed)
    train_set, test_set = load_data(args.seed)

    train_opts = poptorch.Options().deviceIterations(4).randomSeed(args.seed)
    train_opts.Training.gradientAccumulation(2)
    train_opts.showCompilationProgressBar(False)
    train_loader = poptorch.DataLoader(train_opts, train_set, batch_size=16, shuffle=True)

    test_opts = poptorch.Options().deviceIterations(3)
    test_opts.showCompilationProgressBar(False)
    # 450 test images = 10 calls of 3 device iterations x 15 images: nothing dropped
    test_loader = poptorch.DataLoader(test_opts, test_set, batch_size=15)

    model = DigitsCNN()
    optimizer = poptorch.optim.AdamW(model.parameters(), lr=3e-3)
    training = poptorch.trainingModel(model, train_opts, optimizer)
    inference = poptorch.inferenceModel(model, test_opts)

    main_process = int(os.environ.get("RANK", "0")) == 0  # under torchrun: report once
    start = time.perf_counter()
    accuracy = 0.0
    for epoch in range(1, args.epochs + 1):
        bar = tqdm(train_loader, desc=f"epoch {epoch:2d}/{args.epochs}", leave=False,
                   disable=not main_process)
        for images, labels in bar:
            _, loss = training(images, labels)
            bar.set_postfix(loss=f"{loss.item():.3f}")
        counts = torch.tensor([0, len(test_loader) * test_loader.combinedBatchSize])
        for images, labels in test_loader:
            counts[0] += (inference(images).argmax(1) == labels).sum()
        if dist.is_initialized():  # under torchrun: each process tested its share
            dist.all_reduce(counts)
        accuracy = counts[0].item() / counts[1].item()
        if main_process:
            tqdm.write(f"epoch {epoch:2d}: last loss {loss.item():.4f}, "
                       f"test accuracy {accuracy:.2%}")
    seconds = time.perf_counter() - start
    ok = accuracy >= args.target
    if main_process:
        print(f"digits: {args.epochs} epochs, {len(train_set)} training images, "
              f"test accuracy {accuracy:.2%} (target {args.target:.0%}: "
              f"{'reached' if ok else 'MISSED'}) in {seconds:.1f}s on "
              f"{training._compiled.device}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
