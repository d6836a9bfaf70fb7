"""Where tensors live (``Options.TensorLocations``) outside phased execution, and the
host memory CPU IPUs compute in.

``layout``: which replica holds which piece of each optimizer state tensor (replicated
tensor sharding); ``sharding``: the optimizer step over those pieces and the gathered
state dictionary; ``offload``: off-chip (host memory) storage of optimizer state and
activations; ``locations``: reading the options and installing the above on a device
program; ``host_heap``: glibc keeps the memory a step frees for the next step.
"""
