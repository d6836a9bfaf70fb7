"""The distributions a user installs, built here as ``python -m build`` builds them (the
same setuptools backend; offline: no build isolation, no index): the wheel holds every
module of the four packages and the ``poprun`` script, requires a torch of the supported
range (2.11 to 2.15) and no other, and installs next to the torch of this environment
without touching it; the sdist also carries the tests, the examples and the docs.

Installing the wheel into a fresh environment with torch 2.15 and training the digits
example there is the README's "Installing the wheel" (measured in
docs/supported-releases.md); this file checks what can be checked in seconds, offline."""
from __future__ import annotations

import email
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile

import pytest
import torch
from packaging.requirements import Requirement

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = {"poptorch", "popdist", "poprun", "libpvti", "poptorch_geometric"}
SUPPORTED = ("2.11.0", "2.12.1", "2.13.0", "2.14.1", "2.15.0")
PROJECT_FILES = ("pyproject.toml", "README.md", "MANIFEST.in", "mkdocs.yml")
PROJECT_DIRS = ("src", "tests", "examples", "docs")


def _offline_env() -> dict:
    # this machine's pip configuration may cap torch (a constraint file): a user's has not;
    # pip sees the environment's installed packages, not a source tree on PYTHONPATH
    env = dict(os.environ, PIP_CONSTRAINT="/dev/null", PIP_NO_INDEX="1",
               PIP_DISABLE_PIP_VERSION_CHECK="1")
    env.pop("PYTHONPATH", None)
    return env


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> pathlib.Path:
    """The wheel and the sdist of a copy of the project (the build writes egg-info
    folders into the tree it builds)."""
    work = tmp_path_factory.mktemp("packaging")
    tree = work / "project"
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "*.pyc")
    for name in PROJECT_DIRS:
        shutil.copytree(ROOT / name, tree / name, ignore=ignore)
    for name in PROJECT_FILES:
        shutil.copy(ROOT / name, tree / name)
    out = work / "dist"
    wheel = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "--no-index", "-w", str(out), str(tree)],
        capture_output=True, text=True, timeout=300, env=_offline_env())
    assert wheel.returncode == 0, wheel.stdout + wheel.stderr
    sdist = subprocess.run(
        [sys.executable, "-c", "import sys; from setuptools import build_meta; "
         "build_meta.build_sdist(sys.argv[1])", str(out)],
        cwd=tree, capture_output=True, text=True, timeout=300)
    assert sdist.returncode == 0, sdist.stdout + sdist.stderr
    return out


def _wheel(dist: pathlib.Path) -> zipfile.ZipFile:
    (path,) = dist.glob("openpoptorch-*-py3-none-any.whl")
    return zipfile.ZipFile(path)


def test_the_wheel_holds_every_module_and_the_poprun_script(dist):
    names = _wheel(dist).namelist()
    modules = {n for n in names if n.endswith(".py")}
    expected = {p.relative_to(ROOT / "src").as_posix()
                for p in (ROOT / "src").rglob("*.py") if "__pycache__" not in p.parts}
    assert modules == expected
    assert {n.split("/")[0] for n in modules} == PACKAGES
    # nothing but modules: no package data to forget (a non-.py file under a package
    # would need package-data in pyproject.toml)
    assert not [p for p in (ROOT / "src").rglob("*") if p.is_file()
                and p.suffix not in (".py", ".pyc") and "egg-info" not in str(p)]
    (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    text = _wheel(dist).read(entry_points).decode()
    assert "[console_scripts]" in text and "poprun = poprun.cli:main" in text


def test_the_wheel_requires_a_torch_of_the_supported_range(dist):
    (metadata,) = [n for n in _wheel(dist).namelist() if n.endswith(".dist-info/METADATA")]
    message = email.message_from_bytes(_wheel(dist).read(metadata))
    requirements = [Requirement(r) for r in message.get_all("Requires-Dist")]
    (torch_req,) = [r for r in requirements if r.name == "torch" and r.marker is None]
    for release in SUPPORTED:
        assert torch_req.specifier.contains(release), (release, torch_req)
    for release in ("2.10.0", "2.16.0"):
        assert not torch_req.specifier.contains(release), (release, torch_req)
    pyproject = (ROOT / "pyproject.toml").read_text()  # (tomllib: Python 3.11 on)
    declared = Requirement(re.search(r'^\s*"(torch[^"]*)",', pyproject, re.M).group(1))
    assert str(torch_req) == str(declared)
    python = re.search(r'^requires-python = "([^"]+)"', pyproject, re.M).group(1)
    assert message["Requires-Python"] == python


def test_the_wheel_installs_next_to_this_torch_without_touching_it(dist, tmp_path):
    """pip's own plan (``--dry-run --report``, offline) for installing the wheel into
    this environment: the wheel alone; this torch satisfies its requirement and stays
    (a requirement that excluded it would plan another torch, or fail offline)."""
    (wheel,) = dist.glob("*.whl")
    report = tmp_path / "report.json"
    run = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--no-index", "--report",
         str(report), str(wheel)],
        capture_output=True, text=True, timeout=300, env=_offline_env())
    assert run.returncode == 0, run.stdout + run.stderr
    planned = [(item["metadata"]["name"], item["metadata"]["version"])
               for item in json.loads(report.read_text())["install"]]
    assert planned == [("openpoptorch", "3.4.0")], (torch.__version__, planned)


def test_the_sdist_carries_the_tests_examples_and_docs(dist):
    (path,) = dist.glob("openpoptorch-*.tar.gz")
    with tarfile.open(path) as sdist:
        names = {n.split("/", 1)[1] for n in sdist.getnames() if "/" in n}
    for needed in ("pyproject.toml", "README.md", "src/poptorch/__init__.py",
                   "src/poprun/cli.py", "tests/conftest.py", "tests/_processes.py",
                   "tests/custom_ops/scaled_cube.cpp", "examples/train_digits.py",
                   "docs/index.md", "mkdocs.yml"):
        assert needed in names, needed
    assert not [n for n in names if "__pycache__" in n or n.endswith(".pyc")]
