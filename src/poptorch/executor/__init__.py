"""The compiled model a user holds: ``trainingModel`` / ``inferenceModel`` make a
:py:class:`PoplarExecutor`; ``load`` rebuilds one from a file.

``poplar_executor``: the PoplarExecutor object (delegates to ``poptorch._runtime``);
``factory``: trainingModel, inferenceModel, load; ``hooks``: pre/post compile hooks;
``argparsers``: custom argument parsers.
"""
from .factory import inferenceModel, load, trainingModel
from .poplar_executor import PoplarExecutor, isRunningOnIpu

__all__ = ["PoplarExecutor", "inferenceModel", "isRunningOnIpu", "load", "trainingModel"]
