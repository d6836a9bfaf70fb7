"""Names for the values poptorch does not know the type of, defined once.

Each is ``Any`` because the value truly is anything (it comes from the user and poptorch
passes it along or hands it back without depending on its type); everything else in the
package has a real type. A basics module: importable from anywhere, it imports nothing
of the package.
"""
from typing import Any

__all__ = ["OptionValue", "StateValue", "UserInput", "UserOutput"]

UserInput = Any
"""A user's model argument, data-set sample or batch: anything (tensors, tuples, dicts,
the user's own classes) as the user builds it."""

UserOutput = Any
"""What a user's model (or a user's function: loss, collate, step closure) returns:
anything."""

OptionValue = Any
"""An option's value as the user set it: of that option's own type (bool, int, str, an
enum, a list or dict of them), which the reader of the option knows by its name."""

StateValue = Any
"""A value in a ``state_dict`` (an optimizer's per-parameter state, a module's or data
loader's saved state): a tensor, a number, or whatever the user's optimizer or sampler
keeps there, as ``torch.optim.Optimizer.state_dict`` types it."""
