"""One source for the version and for each environment variable's parsing (issue 22)."""
import importlib.metadata
import pathlib
import re

import pytest

import poptorch

ROOT = pathlib.Path(__file__).resolve().parent.parent
SRC = ROOT / "src" / "poptorch"


def test_version_comes_from_the_package_metadata():
    declared = re.search(r'^version\s*=\s*"([^"]+)"', (ROOT / "pyproject.toml").read_text(),
                         re.M).group(1)
    assert poptorch.__version__ == declared
    try:
        assert poptorch.__version__ == importlib.metadata.version("openpoptorch")
    except importlib.metadata.PackageNotFoundError:
        pass  # a source tree on sys.path: pyproject.toml is read (checked above)
    literal = re.compile(re.escape(f'"{declared}"'))
    written = [p.relative_to(SRC).as_posix() for p in SRC.rglob("*.py")
               if literal.search(p.read_text())]
    assert not written, f"the version is written by hand in {written}"


@pytest.mark.parametrize("name,module", [
    ("POPTORCH_BACKEND", "options/jit.py"),
    ("POPLAR_ENGINE_OPTIONS", "_runtime/environment.py"),
    ("PVTI_OPTIONS", "_runtime/environment.py"),
])
def test_each_environment_variable_is_read_in_one_module(name, module):
    readers = [p.relative_to(SRC).as_posix() for p in SRC.rglob("*.py")
               if "os.environ" in p.read_text() and f'"{name}"' in p.read_text()]
    assert readers == [module]
