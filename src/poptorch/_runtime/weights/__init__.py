"""Weights: PopTorch's shallow model copy and host <-> device weight sync."""
