"""PyG's ``Collater`` with every argument optional (PyG's takes the data set first)."""
from __future__ import annotations

from collections.abc import Sequence

from torch_geometric.loader.dataloader import Collater as _PyGCollater

__all__ = ["Collater"]


class Collater(_PyGCollater):
    """Collates a list of ``Data`` / ``HeteroData`` into a PyG ``Batch`` (other items
    as PyG's ``DataLoader`` does).

    Args:
        follow_batch: Keys for which to add a batch assignment vector (``{key}_batch``).
        exclude_keys: Keys to leave out of the batch.
    """

    def __init__(self, follow_batch: Sequence[str] | None = None,
                 exclude_keys: Sequence[str] | None = None) -> None:
        super().__init__(None, list(follow_batch or []), list(exclude_keys or []))
