"""One source for the version and for each environment variable's parsing (issue 22)."""
import importlib.metadata
import pathlib
import re

import pytest
import torch

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


def test_batch_trees_are_torch_pytrees():
    """data/tree.py flattens batches with torch.utils._pytree: same leaves, same order,
    the same structure back (namedtuples, dicts, dict-like classes, non-tensor values)."""
    import collections
    from collections.abc import Mapping

    from torch.utils import _pytree as pytree

    from poptorch.data import tree

    class Record(Mapping):  # a dict-like class pytree does not know
        def __init__(self, items):
            self._items = dict(items)

        def __getitem__(self, key):
            return self._items[key]

        def __iter__(self):
            return iter(self._items)

        def __len__(self):
            return len(self._items)

    Pair = collections.namedtuple("Pair", "a b")
    t = [torch.randn(2, 3) for _ in range(5)]
    batch = {"x": Pair(t[0], [t[1], "label"]), "y": (t[2], 7),
             "r": Record({"u": t[3], "v": t[4]})}
    skeleton, tensors = tree.flatten(batch)
    expected = [x for x in pytree.tree_leaves(batch) if isinstance(x, torch.Tensor)]
    assert len(tensors) == len(expected) == 5
    assert all(torch.equal(a, b) for a, b in zip(tensors, expected, strict=False))  # pytree's order
    rebuilt = tree.unflatten(skeleton, tensors)
    assert type(rebuilt["x"]) is Pair and rebuilt["x"].b[1] == "label" and rebuilt["y"][1] == 7
    assert type(rebuilt["r"]) is Record and torch.equal(rebuilt["r"]["v"], t[4])
    assert all(torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
               for a, b in zip(pytree.tree_leaves(rebuilt), pytree.tree_leaves(batch), strict=False))


def test_the_engine_reads_a_frozen_snapshot_of_the_options():
    """The compiled program reads RuntimeConfig (made once at compile time), not the
    options object: a changed clone of the options, or a setter forced past the
    freeze, cannot reach a compiled model; the snapshot itself cannot be changed."""
    import dataclasses

    from poptorch._runtime.config import RuntimeConfig

    opts = poptorch.Options().deviceIterations(2)
    opts.Training.gradientAccumulation(2)
    config = RuntimeConfig.of(opts)
    assert (config.device_iterations, config.training.gradient_accumulation) == (2, 2)
    assert config.training.reduction == poptorch.ReductionType.Mean
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.device_iterations = 3  # type: ignore[misc]
    with pytest.raises(TypeError):
        config.anchored_tensors["x"] = {}  # type: ignore[index]
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    pop = poptorch.inferenceModel(model, poptorch.Options().deviceIterations(2))
    x = torch.randn(4, 3)
    torch.testing.assert_close(pop(x), model(x))
    assert pop._compiled.config.device_iterations == 2
    assert pop._program.plan.device_iterations == 2
