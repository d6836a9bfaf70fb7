"""``poprun`` for OpenPopTorch: start a PopRun command line on torchrun (see
:py:mod:`poprun.cli` and docs/poprun.md)."""
from .cli import build_plan, main

__all__ = ["build_plan", "main"]
