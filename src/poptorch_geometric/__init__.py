"""PopTorch Geometric: PyTorch Geometric models on PopTorch.

Graph batches of fixed size (``FixedSizeDataLoader``, ``FixedSizeOptions``, the
fixed-size neighbour and cluster loaders) so that a compiled model compiles once,
PyG's graphs as model arguments (``PyGArgsParser``), and static-shape versions of PyG
ops put in place while a model runs. Needs ``torch_geometric`` (the ``geometric``
extra); the compiled PyG extensions (pyg-lib, torch-sparse, torch-scatter,
torch-cluster) are used when installed, never required.
"""
# ruff: noqa: F401, I001  (re-exports; the ops section below stays apart, marked)
from poptorch import __version__

from . import compat, masker
from .cluster_loader import FixedSizeClusterLoader
from .collate import CombinedBatchingCollater, FixedSizeCollater, make_exclude_keys
from .dataloader import DataLoader, FixedSizeDataLoader
from .fixed_size_options import FixedSizeOptions
from .masker import LayerMasker, Masker, NoMasker, PreLayerMasker
from .neighbor_loader import FixedSizeNeighborLoader
from .pyg_dataloader import FixedSizeStrategy, OverSizeStrategy
from .stream_packing_sampler import StreamPackingSampler
from .types import PyGArgsParser, registerCustomArgParsers
from .utils import TrainingStepper, set_aggregation_dim_size

# --- ops and their substitution (ops helper) ---
# The static-shape ops and layers (poptorch_geometric.ops) go in place of PyG's around
# every call of a PopTorch-wrapped model, as PopTorch Geometric registers them.
from poptorch._poplar_executor import _OverwriteContextManager

from . import ops
from .override import _TorchGeometricOpsSubstitutionManager

_OverwriteContextManager.registerSubsitutionManager(_TorchGeometricOpsSubstitutionManager)
# --- end of ops section ---

registerCustomArgParsers()
compat.install()  # data.keys as PopTorch Geometric 3.4's programs read it (compat.py)

__all__ = [
    "CombinedBatchingCollater",
    "DataLoader",
    "FixedSizeClusterLoader",
    "FixedSizeCollater",
    "FixedSizeDataLoader",
    "FixedSizeNeighborLoader",
    "FixedSizeOptions",
    "FixedSizeStrategy",
    "LayerMasker",
    "Masker",
    "NoMasker",
    "OverSizeStrategy",
    "PreLayerMasker",
    "PyGArgsParser",
    "StreamPackingSampler",
    "TrainingStepper",
    "__version__",
    "make_exclude_keys",
    "masker",
    "set_aggregation_dim_size",
]
