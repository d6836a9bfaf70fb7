"""``poptorch.Options`` and its sub-objects: configuration only, validated and recorded.

One module per sub-object: ``training`` (``Options.Training``), ``precision``
(``Options.Precision``), ``tensor_locations`` (``Options.TensorLocations`` and
``TensorLocationSettings``), ``distributed`` (``Options.Distributed``), ``jit``
(``Options.Jit``), ``popart`` (``Options._Popart``); ``options`` holds ``Options`` itself,
``store`` the value store and validators behind all of them, ``config_file`` the safe
reading of config files, ``attribute`` ``poptorch.Attribute``.
"""
# ruff: noqa: F401
from ..annotations.strategies import (
                                      BlockId,
                                      ParallelPhasedExecution,
                                      Phase,
                                      PipelinedExecution,
                                      SerialPhasedExecution,
                                      ShardedExecution,
                                      Stage,
)
from ..errors import ConfigFileError
from .attribute import Attribute
from .distributed import _DistributedOptions
from .jit import _JitOptions
from .options import Options
from .popart import _PopartOptions
from .precision import _PrecisionOptions
from .tensor_locations import TensorLocationSettings, _TensorLocationOptions
from .training import _TrainingOptions

__all__ = [
                                      "Attribute",
                                      "BlockId",
                                      "ConfigFileError",
                                      "Options",
                                      "ParallelPhasedExecution",
                                      "Phase",
                                      "PipelinedExecution",
                                      "SerialPhasedExecution",
                                      "ShardedExecution",
                                      "Stage",
                                      "TensorLocationSettings",
]
