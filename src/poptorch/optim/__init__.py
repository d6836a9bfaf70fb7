"""PopTorch optimizers (``poptorch.optim``): torch.optim's algorithms with PopTorch's
extras (loss scaling, velocity scaling, accumulator types, constant and variable
attributes).

``optimizers``: SGD, Adam, AdamW, RMSprop, LAMB; ``base``: the shared mixin and state
handling; ``updates``: the update formulas; ``attributes``: VariableAttributes and the
rules for changing attributes with ``setOptimizer``.
"""
from .attributes import VariableAttributes
from .base import Optimizer
from .optimizers import LAMB, SGD, Adam, AdamW, RMSprop

__all__ = ["LAMB", "SGD", "Adam", "AdamW", "Optimizer", "RMSprop", "VariableAttributes"]
