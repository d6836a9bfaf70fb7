"""``Options.TensorLocations`` and ``TensorLocationSettings``: where tensors live."""
from __future__ import annotations

from .._typing import OptionValue
from .store import OptionsDict, OptionValueError, check_bool, check_int

_IGNORED_LOCATION_KEYS = ("useReplicatedTensorSharding",
                          "minElementsForReplicatedTensorSharding",
                          "useIOTilesToLoad", "useIOTilesToStore")
# Replicated tensor sharding acts (``_runtime/memory/``): of the optimizer state over
# every replica; of weights and accumulators over the processes (the runtime logs what
# it does with them in one process).
_RTS = ("useReplicatedTensorSharding", "minElementsForReplicatedTensorSharding")
_ACTING = {"optimizer": _RTS, "weight": _RTS, "accumulator": _RTS}


class TensorLocationSettings(OptionsDict):
    """Where a kind of tensor is stored.

    >>> opts = poptorch.Options()
    >>> opts.TensorLocations.setActivationLocation(
    ...     poptorch.TensorLocationSettings().useOnChipStorage(False))

    ``onChip=False`` (off-chip, "streaming memory") and ``minElementsForOffChip`` are
    applied by phased execution (such tensors live in host memory between phases) and,
    for optimizer state and activations, on GPUs (``_runtime/memory/``). Replicated
    tensor sharding acts on the optimizer state; for weights and accumulators it is
    recorded only, as are IO tiles.
    """

    def minElementsForOffChip(self, min_elements: int) -> TensorLocationSettings:
        """Tensors with fewer elements than this are never stored off chip."""
        self.createOrSet(minElementsForOffChip=check_int(
            "TensorLocationSettings.minElementsForOffChip", min_elements, minimum=0))
        return self

    def minElementsForReplicatedTensorSharding(self, min_elements: int
                                               ) -> TensorLocationSettings:
        """Only shard the optimizer state of tensors with at least this many elements
        (default 8192)."""
        self.createOrSet(minElementsForReplicatedTensorSharding=check_int(
            "TensorLocationSettings.minElementsForReplicatedTensorSharding", min_elements,
            minimum=0))
        return self

    def useOnChipStorage(self, use: bool | None = True) -> TensorLocationSettings:
        """True: device memory; False: off chip (host memory); None: undefined."""
        if use is None:
            self.deleteIfExists("onChip")
        else:
            self.createOrSet(onChip=check_bool("TensorLocationSettings.useOnChipStorage",
                                               use))
        return self

    def useReplicatedTensorSharding(self, use: bool = True) -> TensorLocationSettings:
        """Shard the optimizer state over the replicas sharing each tensor (for weights
        and accumulators: recorded only)."""
        self.createOrSet(useReplicatedTensorSharding=check_bool(
            "TensorLocationSettings.useReplicatedTensorSharding", use))
        return self

    def useIOTilesToLoad(self, use: bool = True) -> TensorLocationSettings:
        """Load the tensor through IO tiles (recorded only)."""
        self.createOrSet(useIOTilesToLoad=check_bool(
            "TensorLocationSettings.useIOTilesToLoad", use))
        return self

    def useIOTilesToStore(self, use: bool = True) -> TensorLocationSettings:
        """Store the tensor through IO tiles (recorded only)."""
        self.createOrSet(useIOTilesToStore=check_bool(
            "TensorLocationSettings.useIOTilesToStore", use))
        return self


class NumIOTilesError(OptionValueError):
    """A bad ``numIOTiles``: a ``poptorch.Error`` that is also the ``AssertionError``
    PopTorch raises for it."""


class _TensorLocationOptions(OptionsDict):
    """Options controlling where tensors are stored.

    >>> opts = poptorch.Options()
    >>> opts.TensorLocations.setActivationLocation(
    ...     poptorch.TensorLocationSettings().useOnChipStorage(False))
    """

    _KINDS = ("activation", "weight", "optimizer", "accumulator")

    def __init__(self) -> None:
        super().__init__(num_io_tiles=0, location_activation={}, location_weight={},
                         location_optimizer={}, location_accumulator={})

    def numIOTiles(self, num_tiles: int) -> _TensorLocationOptions:
        """Upstream: tiles reserved for IO, an even number between 32 and 192 (the
        limits are checked as upstream does). Recorded only."""
        check_int("TensorLocations.numIOTiles", num_tiles)
        if num_tiles % 2 or not 32 <= num_tiles <= 192:
            raise NumIOTilesError(f"TensorLocations.numIOTiles: numIOTiles must be an even number "
                        f"between 32 and 192, got {num_tiles}.")
        self.set(num_io_tiles=num_tiles)
        return self

    def _set_location(self, kind: str, location: TensorLocationSettings
                      ) -> _TensorLocationOptions:
        if not isinstance(location, TensorLocationSettings):
            raise OptionValueError(f"TensorLocations.set{kind.capitalize()}Location: "
                                   f"expected a poptorch.TensorLocationSettings, got "
                                   f"{location!r}.")
        self.set(**{f"location_{kind}": location.toDict()})
        return self

    def setActivationLocation(self, location: TensorLocationSettings
                              ) -> _TensorLocationOptions:
        """Where activations are stored."""
        return self._set_location("activation", location)

    def setWeightLocation(self, location: TensorLocationSettings
                          ) -> _TensorLocationOptions:
        """Where weights are stored."""
        return self._set_location("weight", location)

    def setOptimizerLocation(self, location: TensorLocationSettings
                             ) -> _TensorLocationOptions:
        """Where optimizer state is stored."""
        return self._set_location("optimizer", location)

    def setAccumulatorLocation(self, location: TensorLocationSettings
                               ) -> _TensorLocationOptions:
        """Where gradient accumulators are stored."""
        return self._set_location("accumulator", location)

    def _ignored(self) -> dict[str, OptionValue]:
        ignored = {}
        if self._values["num_io_tiles"]:
            ignored["TensorLocations.num_io_tiles"] = self._values["num_io_tiles"]
        for kind in self._KINDS:
            settings = self._values[f"location_{kind}"]
            for key in _IGNORED_LOCATION_KEYS:
                if key in settings and key not in _ACTING.get(kind, ()):
                    ignored[f"TensorLocations.location_{kind}.{key}"] = settings[key]
        return ignored
