"""Batching: splitting a call's inputs into [d][g][r][m] micro-batches, gathering outputs
by output mode, anchored tensors and synthetic inputs."""
