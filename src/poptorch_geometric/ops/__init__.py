"""Static-shape ops and layers of PopTorch Geometric, in plain torch.

``knn``, ``knn_graph``, ``radius`` and ``radius_graph`` return a fixed number of edge
slots per point (``-1`` columns where there is no edge); ``knn_interpolate`` builds on
``knn``; ``fps`` takes PyG's batch vector. The layer classes are PyG's with a forward
pass of fixed shapes. ``poptorch_geometric.override`` puts them in place of PyG's own
while a model runs inside a PopTorch executor.
"""
from .aggregation_base import Aggregation
from .cluster_gcn_conv import ClusterGCNConv
from .hetero_linear import HeteroLinear
from .instance_norm import InstanceNorm
from .knn import knn
from .knn_graph import knn_graph
from .knn_interpolate import knn_interpolate
from .mf_conv import MFConv
from .radius import radius, radius_graph
from .sampling import fps

__all__ = [
    "Aggregation", "ClusterGCNConv", "HeteroLinear", "InstanceNorm", "MFConv", "fps",
    "knn", "knn_graph", "knn_interpolate", "radius", "radius_graph",
]
