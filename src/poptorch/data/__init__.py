"""Feeding a PopTorch model: ``poptorch.DataLoader`` and ``AsynchronousDataAccessor``.

``loader``: the DataLoader (combined batches, modes); ``samplers``: combined batches and
the share of each process; ``accessor`` / ``worker``: the asynchronous loader (a worker
process filling a ring of shared-memory buffers); ``tree``: flattening nested batches;
``faults``: how worker errors and deaths reach the caller; ``resume``: a loader's position
for checkpoints; ``torch_compat``: the torch 2.0 ``Sampler(data_source)`` argument that
PopTorch programs still pass.
"""
from .accessor import AsynchronousDataAccessor
from .loader import DataLoader
from .torch_compat import restore_sampler_data_source_argument

restore_sampler_data_source_argument()

__all__ = ["AsynchronousDataAccessor", "DataLoader"]
