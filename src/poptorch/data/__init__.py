"""Feeding a PopTorch model: ``poptorch.DataLoader`` and ``AsynchronousDataAccessor``.

``loader``: the DataLoader (combined batches, modes); ``samplers``: combined batches and
the share of each process; ``accessor`` / ``worker``: the asynchronous loader (a worker
process filling a ring of shared-memory buffers); ``tree``: flattening nested batches;
``faults``: how worker errors and deaths reach the caller; ``resume``: a loader's position
for checkpoints.
"""
# ruff: noqa: F401
from .accessor import AsynchronousDataAccessor
from .loader import DataLoader

__all__ = ["DataLoader", "AsynchronousDataAccessor"]
