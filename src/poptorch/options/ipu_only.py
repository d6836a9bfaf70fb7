"""What the options that only mean something on an IPU would do there: the text of the
one-time INFO log written when a model compiles with such an option set."""
from __future__ import annotations

# Option name (or prefix ending in ".") -> what it does on an IPU.
_IPU_MEANING = {
    "ipu_version": "compiles for an offline IPU of this version without attaching to "
                   "one (useOfflineIpuTarget); here the model compiles and does not run "
                   "(ConnectionType.Never), and the version itself",
    "connection_type": "chooses when PopTorch attaches to the IPU",
    "sync_pattern": "sets how IPUs synchronise with each other and the host",
    "available_memory_proportion": "bounds the tile memory matmuls and convolutions may "
                                   "use for temporaries",
    "enable_stable_norm": "computes normalisation variances with a more stable formula",
    "log_cycle_count": "counts IPU cycles",
    "module_namescope": "names graph operations after the modules they come from",
    "source_location_excludes": "leaves these paths out of operation debug locations",
    "Jit.trace_model": "uses the torch.jit.trace frontend",
    "TensorLocations.num_io_tiles": "reserves this many tiles per IPU for IO that "
                                    "overlaps compute (the overlap settings use them)",
    "TensorLocations.location_": "places these tensors in streaming memory or shards "
                                 "them across replicas at tile level",
    "Training.convolution_dithering": "dithers the tile mapping of convolutions",
    "_Popart.": "passes this option to the PopART session",
}


def ipu_meaning(name: str) -> str:
    """What option ``name`` does on an IPU (a generic phrase if not listed)."""
    if name in _IPU_MEANING:
        return _IPU_MEANING[name]
    for key, meaning in _IPU_MEANING.items():
        if key.endswith((".", "_")) and name.startswith(key):
            return meaning
    return "configures the IPU toolchain"
