"""What PopTorch 3.4 programs (written for torch 2.0) rely on in ``torch.utils.data``
and newer torch removed.

``torch.utils.data.Sampler.__init__`` took a ``data_source`` argument up to torch 2.x
(unused; deprecated from 2.2, then removed with the whole ``__init__``). Custom samplers
written for PopTorch call ``super().__init__(data_source)`` or ``super().__init__(None)``,
which on a torch without it reaches ``object.__init__`` and fails with
"object.__init__() takes exactly one argument". Importing poptorch gives ``Sampler`` back
an ``__init__`` that accepts (and ignores, as torch did) that argument; calls without it
are unchanged, and so is every torch that still has its own.
"""
from __future__ import annotations

import torch.utils.data

from .._runtime.attributes import defines

__all__ = ["restore_sampler_data_source_argument"]


def _sampler_init(self: torch.utils.data.Sampler, data_source: object = None, *args: object,
                  **kwargs: object) -> None:
    """Accepts torch 2.0's unused ``data_source`` argument; passes anything else on
    (cooperative multiple inheritance keeps working)."""
    super(torch.utils.data.Sampler, self).__init__(*args, **kwargs)


_sampler_init._poptorch_compat = True  # type: ignore[attr-defined]  # (a function attribute marking ours)


def restore_sampler_data_source_argument() -> None:
    """Installs :func:`_sampler_init` if this torch's ``Sampler`` has no ``__init__``."""
    sampler = torch.utils.data.Sampler
    if not defines(sampler, "__init__"):
        sampler.__init__ = _sampler_init  # type: ignore[method-assign, assignment]  # (torch 2.0's __init__ back, over object's)
