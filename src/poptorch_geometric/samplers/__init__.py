"""Samplers written with torch operations, for a PyG without its compiled extensions:
``neighbor`` (neighbour sampling) and ``partition`` (graph partitions for clusters)."""
