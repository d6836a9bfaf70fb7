"""``poptorch._poplar_executor``: upstream's module path of :py:class:`PoplarExecutor`,
which libraries use in ``isinstance`` checks (optimum-graphcore's pipelines), and of
``_OverwriteContextManager``, where libraries register substitution managers
(PopTorch Geometric: ``_OverwriteContextManager.registerSubsitutionManager(cls)``).
"""
from ._overrides import _OverwriteContextManager
from .executor.poplar_executor import PoplarExecutor

__all__ = ["PoplarExecutor", "_OverwriteContextManager"]
