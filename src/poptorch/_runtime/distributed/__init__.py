"""Several processes on ``torch.distributed`` (what PopRun was to PopTorch): the process
group, replicas kept identical, stages on processes, coalesced collectives."""
