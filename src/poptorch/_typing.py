"""Names for the values poptorch does not know the type of, defined once.

Each is ``Any`` because the value truly is anything (it comes from the user and poptorch
passes it along or hands it back without depending on its type); everything else in the
package has a real type. A basics module: importable from anywhere, it imports nothing
of the package.
"""
from typing import Any, Protocol

__all__ = ["DatasetKey", "OptionValue", "OptionsView", "ParamGroup", "StateDict", "StateValue",
           "UserInput", "UserOutput"]

UserInput = Any
"""A user's model argument, data-set sample or batch: anything (tensors, tuples, dicts,
the user's own classes) as the user builds it."""

UserOutput = Any
"""What a user's model (or a user's function: loss, collate, step closure) returns:
anything."""

DatasetKey = Any
"""What a sampler yields to index a user's data set: an int, a list of them (a batch
sampler's), or the user's own key."""

OptionValue = Any
"""An option's value as the user set it: of that option's own type (bool, int, str, an
enum, a list or dict of them), which the reader of the option knows by its name."""

StateValue = Any
"""A value in a ``state_dict`` (an optimizer's per-parameter state, a module's or data
loader's saved state): a tensor, a number, or whatever the user's optimizer or sampler
keeps there, as ``torch.optim.Optimizer.state_dict`` types it."""

StateDict = dict[str, Any]
"""A ``state_dict()``: names to :data:`StateValue` (torch's own ``StateDict`` type)."""

ParamGroup = dict[str, Any]
"""One of ``torch.optim.Optimizer.param_groups``: ``"params"`` and hyperparameters of
each optimizer's own kinds (floats, tuples, bools, dtypes, the user's own), as torch
types it."""


class OptionsView(Protocol):
    """A ``poptorch.Options``, or one of its option groups (``Options.Precision``, ...),
    as the modules below the public layer read it (they do not import it): option values
    and groups by name (:data:`OptionValue`), and whether an option was set."""

    def __getattr__(self, name: str) -> OptionValue: ...
    def exists(self, option: str) -> bool: ...
