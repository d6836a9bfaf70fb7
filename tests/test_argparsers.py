"""Custom argument parsers: user types flatten and rebuild through torch.utils._pytree."""
import logging

import pytest
import torch
import torch.utils._pytree as pytree

import poptorch


class Pair:
    def __init__(self, tensors=None, label="pair"):
        self.a = dict(tensors or {})
        self.label = label


class PairParser(poptorch.ICustomArgParser):
    def yieldTensors(self, struct):
        for key in sorted(struct.a):
            yield struct.a[key]

    def reconstruct(self, original_structure, tensor_iterator):
        out = Pair(label=original_structure.label)
        for key in sorted(original_structure.a):
            out.a[key] = next(tensor_iterator)
        return out


@pytest.fixture
def registered():
    poptorch.registerCustomArgParser(Pair, PairParser())
    yield
    poptorch.registerCustomArgParser(Pair, None)


def test_round_trip_through_pytree(registered):
    t0, t1 = torch.randn(4, 2), torch.randn(4)
    value = {"x": Pair({"t1": t1, "t0": t0}), "y": torch.ones(2)}
    leaves, spec = pytree.tree_flatten(value)
    assert leaves[0] is t0 and leaves[1] is t1 and len(leaves) == 3
    # the executor splits inputs into micro-batches with tree_map: the same happens here
    halves = pytree.tree_map(lambda t: t[:2], value)
    assert isinstance(halves["x"], Pair) and halves["x"].label == "pair"
    torch.testing.assert_close(halves["x"].a["t0"], t0[:2])
    torch.testing.assert_close(halves["x"].a["t1"], t1[:2])
    rebuilt = pytree.tree_unflatten([leaf * 2 for leaf in leaves], spec)
    torch.testing.assert_close(rebuilt["x"].a["t0"], t0 * 2)
    torch.testing.assert_close(rebuilt["y"], torch.ones(2) * 2)


def test_replace_and_remove_parser(registered):
    class FirstOnly(PairParser):
        def yieldTensors(self, struct):
            yield struct.a[sorted(struct.a)[0]]

        def reconstruct(self, original_structure, tensor_iterator):
            out = Pair(original_structure.a)
            out.a[sorted(out.a)[0]] = next(tensor_iterator)
            return out

    poptorch.registerCustomArgParser(Pair, FirstOnly())
    leaves, _ = pytree.tree_flatten(Pair({"a": torch.ones(1), "b": torch.zeros(1)}))
    assert len(leaves) == 1
    poptorch.registerCustomArgParser(Pair, None)
    leaves, _ = pytree.tree_flatten(Pair({"a": torch.ones(1)}))
    assert len(leaves) == 1 and isinstance(leaves[0], Pair)  # an opaque leaf again
    poptorch.registerCustomArgParser(Pair, PairParser())


def test_bad_registrations():
    with pytest.raises(TypeError, match="ICustomArgParser"):
        poptorch.registerCustomArgParser(Pair, object())
    with pytest.raises(TypeError, match="already a pytree node"):
        poptorch.registerCustomArgParser(tuple, PairParser())
    with pytest.raises(TypeError, match="abstract"):
        poptorch.ICustomArgParser()


def test_geometric_parsers_without_torch_geometric(caplog, monkeypatch):
    """Without torch_geometric the registration is a logged no-op (simulated here: the
    suite's environment may have torch_geometric installed)."""
    import importlib.util

    from poptorch import _logging
    from poptorch.executor import argparsers
    real_find_spec = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        return None if name == "torch_geometric" else real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr(argparsers.importlib.util, "find_spec", find_spec)
    monkeypatch.setattr(_logging, "_once_keys", set())
    before = dict(argparsers._parsers)
    with caplog.at_level(logging.INFO, logger="poptorch::python"):
        poptorch.registerGeometricCustomArgParsers()
    assert "torch_geometric is not installed" in caplog.text
    assert argparsers._parsers == before


def test_geometric_parsers_come_with_the_add_on(monkeypatch):
    """The core never imports poptorch_geometric: it registers itself when imported
    (registerArgParserAddOn); before that, asking the core for PyG's parsers says so."""
    import importlib.util

    from poptorch.executor import argparsers
    if importlib.util.find_spec("torch_geometric") is None:
        pytest.skip("torch_geometric is not installed")
    monkeypatch.setattr(argparsers, "_addons", {})
    with pytest.raises(ImportError, match="import poptorch_geometric"):
        poptorch.registerGeometricCustomArgParsers()
    calls = []
    argparsers.registerArgParserAddOn("torch_geometric", lambda: calls.append(1))
    poptorch.registerGeometricCustomArgParsers()
    assert calls == [1]


def test_importing_poptorch_imports_no_add_on():
    import subprocess
    import sys
    code = ("import sys, poptorch; print(sorted(m for m in sys.modules if m.split('.')[0] "
            "in ('poptorch_geometric', 'popdist', 'poprun', 'libpvti')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]"
