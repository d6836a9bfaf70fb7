"""``Options._Popart``: upstream PopART session options (recorded only)."""
from __future__ import annotations

import copy

from .._typing import OptionValue
from .store import OptionsFrozenError, OptionValueError, check_bool, check_int, check_str

# PopART options that change results and act here too (the rest are recorded only):
# groupNormStridedChannelGrouping (_runtime/numerics/strided_group_norm.py),
# syntheticDataMode (0 off, 1 zeros, 2 random normal: _runtime/batching/synthetic.py).
_ACTING = frozenset({"groupNormStridedChannelGrouping", "syntheticDataMode"})

# The value types upstream can hand to PopART (its option parser refuses any other
# with "Unknown value type"): bool, int, float, str, list / tuple / set, dict.
_PASSABLE = (bool, int, float, str, list, tuple, set, frozenset, dict)


def _check_value(key: str, value: OptionValue) -> OptionValue:
    """``value`` if PopART could take it for ``key``, else a clear error."""
    if not isinstance(value, _PASSABLE):
        raise OptionValueError(
            f"_Popart.set({key!r}, ...): PopART options take a bool, int, float, str, "
            f"list, tuple, set or dict; got {value!r} ({type(value).__name__}).")
    if key == "syntheticDataMode":
        check_int("_Popart.set('syntheticDataMode')", value, minimum=0, maximum=2)
    elif key == "groupNormStridedChannelGrouping":
        check_bool("_Popart.set('groupNormStridedChannelGrouping')", value)
    return value


class _PopartOptions:
    """Options of upstream's PopART backend (``opts._Popart.set(name, value)``).

    There is no PopART here: the values are accepted and recorded, reported by
    ``Options._ignored_options()`` and logged once at INFO when a model is compiled,
    except the options that change results and act here too (``_ACTING``).
    """

    def __init__(self) -> None:
        self.options: dict[str, OptionValue] = {}
        self._frozen = False

    def checkIsFrozen(self, option: str | None = None) -> None:
        """Raise :py:class:`poptorch.Error` if these options can no longer change."""
        if self._frozen:
            what = f"option '_Popart.{option}'" if option else "them"
            raise OptionsFrozenError(
                f"Options are frozen: a model or a poptorch.DataLoader uses them, so "
                f"changing {what} would not take effect. Use opts.clone() to get an "
                f"unfrozen copy.")

    def set(self, key: str, value: OptionValue) -> _PopartOptions:
        """Record the PopART session option ``key``."""
        check_str("_Popart.set", key)
        self.checkIsFrozen(key)
        self.options[key] = _check_value(key, value)
        return self

    def setEngineOptions(self, engine_options: dict) -> _PopartOptions:
        """Record Poplar engine options."""
        if not isinstance(engine_options, dict):
            raise OptionValueError(f"_Popart.setEngineOptions: expected a dict, got "
                                   f"{engine_options!r}.")
        return self.set("engineOptions", dict(engine_options))

    def setPatterns(self, patterns: dict, level: int = 2) -> _PopartOptions:
        """Record PopART pattern overrides (``{name: enabled}``) and the pattern level."""
        if not isinstance(patterns, dict):
            raise OptionValueError(f"_Popart.setPatterns: expected a dict of pattern name "
                                   f"-> bool, got {patterns!r}.")
        check_int("_Popart.setPatterns level", level, minimum=0)
        self.set("patterns", dict(patterns))
        return self.set("patternsLevel", level)

    def toDict(self) -> dict[str, OptionValue]:
        return copy.deepcopy(self.options)

    def _freeze(self) -> None:
        self._frozen = True

    def _unfreeze(self) -> None:
        self._frozen = False

    def _ignored(self) -> dict[str, OptionValue]:
        return {f"_Popart.{key}": value for key, value in self.options.items()
                if key not in _ACTING}

    def __repr__(self) -> str:
        return f"_PopartOptions({self.options!r})"
