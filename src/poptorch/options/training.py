"""``Options.Training``: gradient accumulation, reductions, loss scaling."""
from __future__ import annotations

from typing import ClassVar

from .. import enums
from .._typing import OptionValue
from .popart import _PopartOptions
from .store import OptionChoiceError, OptionsDict, check_bool, check_enum, check_int


class _TrainingOptions(OptionsDict):
    """Options specific to model training.

    Can be accessed via :py:attr:`poptorch.Options.Training`:

    >>> opts = poptorch.Options()
    >>> opts.Training.gradientAccumulation(4)
    """

    _ASSIGNMENT_SETTERS: ClassVar[dict[str, str]] = {
        "gradient_accumulation": "gradientAccumulation"}

    def __init__(self, popart_options: _PopartOptions | None = None) -> None:
        super().__init__(
            gradient_accumulation=1,
            accumulation_and_replication_reduction_type=enums.ReductionType.Mean,
            meanAccumulationAndReplicationReductionStrategy=enums.MeanReductionStrategy.Post,
            automatic_loss_scaling=False,
            convolution_dithering=False)
        self._popart = popart_options

    def gradientAccumulation(self, gradient_accumulation: int) -> _TrainingOptions:
        """Number of micro-batches whose gradients are accumulated before each
        optimizer update."""
        self.set(gradient_accumulation=check_int("Training.gradientAccumulation",
                                                 gradient_accumulation, minimum=1))
        return self

    def accumulationAndReplicationReductionType(
            self, reduction_type: enums.ReductionType) -> _TrainingOptions:
        """How gradients of accumulated micro-batches and replicas are combined:
        ``ReductionType.Mean`` (default) or ``ReductionType.Sum``."""
        self.set(accumulation_and_replication_reduction_type=check_enum(
            "Training.accumulationAndReplicationReductionType", reduction_type,
            enums.ReductionType, (enums.ReductionType.Sum, enums.ReductionType.Mean),
            error=OptionChoiceError))
        return self

    def accumulationReductionType(self, reduction_type: enums.ReductionType
                                  ) -> _TrainingOptions:
        """Old name (SDK 1.x / 2.0) of :py:meth:`accumulationAndReplicationReductionType`."""
        return self.accumulationAndReplicationReductionType(reduction_type)

    def setMeanAccumulationAndReplicationReductionStrategy(
            self, mean_reduction_strategy: enums.MeanReductionStrategy
    ) -> _TrainingOptions:
        """When the mean reduction divides: ``Running``, ``Post`` or ``PostAndLoss``."""
        self.set(meanAccumulationAndReplicationReductionStrategy=check_enum(
            "Training.setMeanAccumulationAndReplicationReductionStrategy",
            mean_reduction_strategy, enums.MeanReductionStrategy))
        return self

    def setAutomaticLossScaling(self, enabled: bool) -> _TrainingOptions:
        """Adjust the loss scale automatically during training (float16 models)."""
        self.set(automatic_loss_scaling=check_bool("Training.setAutomaticLossScaling",
                                                   enabled))
        return self

    def setConvolutionDithering(self, enabled: bool) -> _TrainingOptions:
        """Upstream: spread convolutions over different tiles. Recorded only. ``1`` /
        ``0`` mean True / False, as upstream (which passes the value to Poplar as the
        string ``"1"`` / ``"0"``)."""
        if not isinstance(enabled, bool) and type(enabled) is int and enabled in (0, 1):
            enabled = bool(enabled)
        self.set(convolution_dithering=check_bool("Training.setConvolutionDithering",
                                                  enabled))
        return self

    def _ignored(self) -> dict[str, OptionValue]:
        if self._values["convolution_dithering"]:
            return {"Training.convolution_dithering": True}
        return {}
