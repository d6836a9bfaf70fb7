"""Replication across processes on ``torch.distributed`` (what PopRun was to PopTorch).

``world``: joining (or reusing) the process group and the facts of this process's place
in it; ``consistency``: the check that every process compiled the same program;
``collectives``: coalesced broadcast / all-reduce of many tensors; ``reducer``: the
gradient reduction of one optimizer step over all replicas of all processes;
``replicas``: what a compiled model does across processes at compile time and after
each step (weights, optimizer state and buffers kept identical).
"""
