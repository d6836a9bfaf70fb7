"""Model parallelism: block markers, partitioning into stages and phases, and the
pipelined, sharded and phased runners."""
