"""``poptorch._poplar_executor``: upstream's module path of :py:class:`PoplarExecutor`,
which libraries use in ``isinstance`` checks (optimum-graphcore's pipelines)."""
from .executor.poplar_executor import PoplarExecutor

__all__ = ["PoplarExecutor"]
