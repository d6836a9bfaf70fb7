"""``Options.Precision``: numerical precision of the model and its updates."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .. import enums
from ..errors import Error
from .popart import _PopartOptions
from .store import OptionChoiceError, OptionsDict, check_bool, check_enum

if TYPE_CHECKING:
    from ..autocasting import Policy


class _PrecisionOptions(OptionsDict):
    """Options related to numerical precision.

    Can be accessed via :py:attr:`poptorch.Options.Precision`:

    >>> opts = poptorch.Options()
    >>> opts.Precision.enableFloatingPointExceptions(True)
    """

    def __init__(self, popart_options: _PopartOptions | None = None) -> None:
        super().__init__(half_float_casting=enums.HalfFloatCastingBehavior.Default,
                         running_statistics_always_float=True,
                         floating_point_exceptions=False,
                         stochastic_rounding=False,
                         partials_type=torch.float32,
                         autocast_enabled=True,
                         autocast_policy=None)
        self._popart = popart_options

    def autocastEnabled(self, autocast_enabled: bool) -> _PrecisionOptions:
        """Whether automatic casting (``poptorch.autocast``, ``model.autocast()``) is
        applied at all. Default: True; False runs every autocast region unchanged."""
        self.set(autocast_enabled=check_bool("Precision.autocastEnabled",
                                             autocast_enabled))
        return self

    def autocastPolicy(self, autocast_policy: Policy
                       ) -> _PrecisionOptions:
        """The casting policy of automatic casting regions (default:
        ``poptorch.autocasting.default``)."""
        from ..autocasting import Policy  # the policy type lives in the public layer
        if not isinstance(autocast_policy, Policy):
            raise Error("Precision.autocastPolicy: expected a poptorch.autocasting.Policy, "
                        f"got {type(autocast_policy).__name__}.")
        self.set(autocast_policy=autocast_policy)
        return self

    def halfFloatCasting(self, half_float_casting: enums.HalfFloatCastingBehavior
                         ) -> _PrecisionOptions:
        """How operations mixing float16 and float32 inputs are computed. ``Default``:
        a model's weights follow its activations' precision, other mixes follow
        PyTorch's promotion; ``FloatDowncastToHalf`` / ``HalfUpcastToFloat`` compute
        every mixed operation in float16 / float32 (docs/precision.md)."""
        self.set(half_float_casting=check_enum("Precision.halfFloatCasting",
                                               half_float_casting,
                                               enums.HalfFloatCastingBehavior))
        return self

    def runningStatisticsAlwaysFloat(self, value: bool) -> _PrecisionOptions:
        """Keep batch-norm running statistics in float32 even in a float16 model."""
        self.set(running_statistics_always_float=check_bool(
            "Precision.runningStatisticsAlwaysFloat", value, error=OptionChoiceError))
        return self

    def enableFloatingPointExceptions(self, enabled: bool) -> _PrecisionOptions:
        """Raise an error when an operation produces inf or NaN (overflow, 0/0, ...)."""
        self.set(floating_point_exceptions=check_bool(
            "Precision.enableFloatingPointExceptions", enabled))
        return self

    def enableStochasticRounding(self, enabled: bool) -> _PrecisionOptions:
        """Round float16 results up or down at random, unbiased on average."""
        self.set(stochastic_rounding=check_bool("Precision.enableStochasticRounding",
                                                enabled))
        return self

    def setPartialsType(self, dtype: torch.dtype) -> _PrecisionOptions:
        """Data type of the partial results of matmuls and convolutions:
        ``torch.float`` or ``torch.half``."""
        if dtype not in (torch.float32, torch.float16):
            raise OptionChoiceError(f"Precision.setPartialsType: expected torch.float or "
                                    f"torch.half, got {dtype!r}.")
        self.set(partials_type=dtype)
        return self
