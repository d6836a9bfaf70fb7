"""The package version, from the installed package's metadata (pyproject.toml is the
one place it is written)."""
from __future__ import annotations

import pathlib
import re
from importlib import metadata

__all__ = ["__version__"]


def _version() -> str:
    try:
        return metadata.version("openpoptorch")
    except metadata.PackageNotFoundError:
        # a source tree put on sys.path without installing it: read pyproject.toml
        pyproject = pathlib.Path(__file__).resolve().parents[2] / "pyproject.toml"
        try:
            found = re.search(r'^version\s*=\s*"([^"]+)"', pyproject.read_text(), re.M)
        except OSError:
            found = None
        return found.group(1) if found else "0+unknown"


__version__ = _version()
