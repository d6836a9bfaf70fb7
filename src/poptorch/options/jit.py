"""``Options.Jit``: how the model is captured and which backend compiles it."""
from __future__ import annotations

import os

from .._typing import OptionValue
from ..errors import Error
from .store import OptionsDict, OptionValueError, check_truth

_BACKENDS = ("eager", "inductor", "fastest")


class _JitOptions(OptionsDict):
    """Options related to capturing and compiling the model.

    Can be accessed via :py:attr:`poptorch.Options.Jit`:

    >>> opts = poptorch.Options()
    >>> opts.Jit.backend("eager")
    """

    def __init__(self) -> None:
        super().__init__(trace_model=False, backend=None)

    def traceModel(self, trace_model: bool) -> _JitOptions:
        """Upstream: trace the model with ``torch.jit.trace`` (deprecated). Recorded only:
        models are always captured the same way here. Read as a truth value (upstream
        takes any false value, such as ``0`` or ``None``, for False)."""
        self.set(trace_model=check_truth("Jit.traceModel", trace_model))
        return self

    @property
    def backend(self) -> _BackendName | _AutoBackend:
        """The compiler backend: ``"eager"``, ``"inductor"``, ``"fastest"`` or automatic.

        ``"fastest"`` compiles like ``"inductor"``; the model then times its compiled
        program against the eager loop over its first calls and keeps the faster one.

        Reads as the chosen backend name (a ``str``: ``opts.Jit.backend == "eager"``);
        call it to choose one (``opts.Jit.backend("inductor")``, ``None`` for
        automatic). When not chosen explicitly, the ``POPTORCH_BACKEND`` environment
        variable decides; otherwise it is automatic: falsy and ``== None`` (but not
        ``is None``), and the executor picks ``"fastest"`` (``"eager"`` where no C++
        compiler is present). Use
        :py:attr:`backend_name` to read a plain ``str`` or ``None``.
        """
        name = self.backend_name
        return _AutoBackend(self) if name is None else _BackendName(name, self)

    @property
    def backend_name(self) -> str | None:
        """The chosen backend as a plain value: explicit, else ``POPTORCH_BACKEND``,
        else None (automatic)."""
        explicit = self._values["backend"]
        if explicit is not None:
            return explicit
        env = os.environ.get("POPTORCH_BACKEND")
        if env is None or env.strip() == "" or env.strip().lower() == "auto":
            return None
        name = env.strip().lower()
        if name not in _BACKENDS:
            raise Error(f"POPTORCH_BACKEND environment variable: unknown backend {env!r}; "
                        f"use one of {', '.join(_BACKENDS)} (or unset it).")
        return name

    def _set_backend(self, name: str | None) -> _JitOptions:
        if name is not None:
            if not isinstance(name, str) or name.lower() not in _BACKENDS:
                choices = ", ".join(map(repr, _BACKENDS))
                raise OptionValueError(f"Jit.backend: expected one of {choices} or None "
                                       f"(automatic), got {name!r}.")
            name = name.lower()
        self.set(backend=name)
        return self

    def _ignored(self) -> dict[str, OptionValue]:
        return {"Jit.trace_model": True} if self._values["trace_model"] else {}


class _BackendName(str):
    """``opts.Jit.backend`` once a backend is chosen: the name itself (a real ``str``),
    callable to choose another one."""

    _jit: _JitOptions

    def __new__(cls, name: str, jit: _JitOptions) -> _BackendName:
        obj = super().__new__(cls, name)
        obj._jit = jit
        return obj

    def __call__(self, name: str | None) -> _JitOptions:
        return self._jit._set_backend(name)


class _AutoBackend:
    """``opts.Jit.backend`` while no backend is chosen: falsy and equal to None,
    callable to choose one."""

    __slots__ = ("_jit",)

    def __init__(self, jit: _JitOptions) -> None:
        self._jit = jit

    def __call__(self, name: str | None) -> _JitOptions:
        return self._jit._set_backend(name)

    def __eq__(self, other: object) -> bool:
        return other is None or isinstance(other, _AutoBackend)

    def __hash__(self) -> int:
        return hash(None)

    def __bool__(self) -> bool:
        return False

    def __repr__(self) -> str:
        return "None"
