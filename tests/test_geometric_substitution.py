"""Substitution managers: PopTorch Geometric's ops replace PyG's only while a wrapped
model runs, and everything is put back afterwards, also when the call raises."""
from __future__ import annotations

import contextlib
import types
from typing import ClassVar

import pytest
import torch

torch_geometric = pytest.importorskip("torch_geometric")

import poptorch  # noqa: E402
import poptorch._poplar_executor  # noqa: E402
from poptorch import _overrides  # noqa: E402
from poptorch._overrides import _OverwriteContextManager, substitutions  # noqa: E402
from poptorch_geometric import ops, override  # noqa: E402
from poptorch_geometric.override import _TorchGeometricOpsSubstitutionManager  # noqa: E402

MANAGER = _TorchGeometricOpsSubstitutionManager


@pytest.fixture(autouse=True)
def _registered():
    # importing poptorch_geometric registers it; registering again does nothing
    _OverwriteContextManager.registerSubsitutionManager(MANAGER)
    assert MANAGER in _OverwriteContextManager._subsitution_manager_types


def _current():
    """{(target, name): (object now there, whether the target defines it itself)}."""
    return {(target, name): (getattr(target, name), name in vars(target))
            for target, table in MANAGER.subsitutions.items() for name in table}


class _Recorder(torch.nn.Module):
    """Records what the substituted names hold while the model runs."""

    def __init__(self, fail=False):
        super().__init__()
        self.seen, self.fail = [], fail

    def forward(self, x):
        self.seen.append(_current())
        if self.fail:
            raise RuntimeError("model failed on purpose")
        return x + 1


def test_pyg_is_replaced_only_while_a_model_runs():
    before = _current()
    assert before[(torch_geometric.nn.MFConv, "forward")][0] is not ops.MFConv.forward
    model = _Recorder()
    poptorch.inferenceModel(model)(torch.ones(2))
    assert model.seen, "the model did not run"
    for key, (inside, _) in model.seen[0].items():
        assert inside is not before[key][0], f"{key} was not replaced inside the model"
        assert inside.__wrapped__ is before[key][0]  # keeps PyG's name and signature
    assert _current() == before  # same objects, no attribute left on a subclass
    assert not _overrides.substitutions_active()


def test_pyg_is_restored_when_the_call_raises():
    before = _current()
    failing = poptorch.inferenceModel(_Recorder(fail=True))
    with pytest.raises(RuntimeError, match="on purpose"):
        failing(torch.ones(2))
    assert _current() == before
    model = _Recorder()
    poptorch.inferenceModel(model)(torch.ones(2))
    assert model.seen and model.seen[-1] != before


def test_the_installed_objects_are_the_same_on_every_call():
    """A compiled program that captured a replacement sees the same object each call."""
    model = _Recorder()
    wrapped = poptorch.inferenceModel(model)
    for _ in range(3):
        wrapped(torch.ones(2))
    assert len(model.seen) == 3
    assert model.seen[0] == model.seen[1] == model.seen[2]


def _knn_graph_edges(x, batch, k):
    """{(neighbour, centre)}: each point's k nearest others of its example."""
    edges = set()
    for i in range(x.shape[0]):
        others = [j for j in range(x.shape[0]) if j != i and batch[j] == batch[i]]
        others.sort(key=lambda j: float(((x[j] - x[i]) ** 2).sum()))
        edges |= {(j, i) for j in others[:k]}
    return edges


def _radius_graph_edges(x, batch, r):
    return {(j, i) for i in range(x.shape[0]) for j in range(x.shape[0])
            if j != i and batch[j] == batch[i] and float((x[j] - x[i]).norm()) <= r}


def test_pyg_point_functions_give_pyg_results_inside_a_model():
    """PyG 2.8's knn_graph / radius_graph need pyg-lib; inside a model they are
    replaced and return PyG's result: only real edges, no -1 slots."""
    torch.manual_seed(0)
    x = torch.randn(14, 3)
    batch = torch.tensor([0] * 4 + [1] * 10)  # example 0 has fewer points than k + 1

    class Graphs(torch.nn.Module):
        def forward(self, x, batch):
            knn = torch_geometric.nn.knn_graph(x, 5, batch)
            radius = torch_geometric.nn.pool.radius_graph(x, 1.3, batch)
            return knn, radius

    knn, radius = poptorch.inferenceModel(Graphs())(x, batch)
    assert not bool((knn < 0).any()) and not bool((radius < 0).any())
    assert {tuple(e) for e in knn.t().tolist()} == _knn_graph_edges(x, batch, 5)
    assert len(knn.t().tolist()) == 3 * 4 + 5 * 10  # no duplicates either
    assert {tuple(e) for e in radius.t().tolist()} == _radius_graph_edges(x, batch, 1.3)


def test_interpolation_nearest_and_fps_inside_a_model():
    torch.manual_seed(1)
    pos_x, pos_y = torch.randn(10, 2), torch.randn(6, 2)
    features = torch.randn(10, 3)
    batch_x = torch.tensor([0] * 5 + [1] * 5)
    batch_y = torch.tensor([0, 0, 0, 1, 1, 1])

    class PointNetPieces(torch.nn.Module):
        def forward(self, features, pos_x, pos_y, batch_x, batch_y):
            return (torch_geometric.nn.knn_interpolate(features, pos_x, pos_y, batch_x,
                                                       batch_y, k=2),
                    torch_geometric.nn.nearest(pos_x, pos_y, batch_x, batch_y),
                    torch_geometric.nn.fps(pos_x, batch_x, 0.6, random_start=False))

    inputs = (features, pos_x, pos_y, batch_x, batch_y)
    interpolated, nearest, sampled = poptorch.inferenceModel(PointNetPieces())(*inputs)
    torch.testing.assert_close(interpolated, ops.knn_interpolate(*inputs, k=2))
    assert torch.equal(nearest, poptorch.nearest(pos_x, pos_y, batch_x, batch_y))
    assert sampled.tolist() == poptorch.fps(pos_x, [0, 5, 10], 0.6).tolist()


def test_torch_cluster_functions_are_replaced_when_it_is_installed(monkeypatch):
    """torch-cluster cannot be built here: a stand-in module with its function names
    takes its place in the table, as ``registerOptionalOverrides`` puts the real one."""
    stand_in = types.ModuleType("torch_cluster")

    def unavailable(*args, **kwargs):
        raise ImportError("the stand-in has no kernels")

    for name in ("knn", "knn_graph", "radius", "radius_graph", "nearest", "fps"):
        setattr(stand_in, name, unavailable)
    monkeypatch.setitem(MANAGER.subsitutions, stand_in, {})
    override._add_torch_cluster(stand_in)
    assert set(MANAGER.subsitutions[stand_in]) == {"knn", "knn_graph", "radius",
                                                   "radius_graph", "nearest"}

    class UsesTorchCluster(torch.nn.Module):
        def forward(self, x, y):
            return stand_in.knn(x, y, 2), stand_in.nearest(y, x)

    torch.manual_seed(3)
    x, y = torch.randn(6, 2), torch.randn(3, 2)
    assign, nearest = poptorch.inferenceModel(UsesTorchCluster())(x, y)
    assert torch.equal(assign, ops.knn(x, y, 2))  # 6 points: every slot used
    assert torch.equal(nearest, poptorch.nearest(y, x))
    assert stand_in.knn is unavailable and stand_in.fps is unavailable


# -- the registry (poptorch._overrides) ------------------------------------------------

class _Counting:
    log: ClassVar[list] = []

    def replace(self):
        self.log.append(("replace", type(self).__name__))

    def restore(self):
        self.log.append(("restore", type(self).__name__))


class _First(_Counting):
    pass


class _Second(_Counting):
    pass


class _Broken(_Counting):
    def replace(self):
        raise KeyError("cannot replace")


@pytest.fixture
def registry():
    types = _OverwriteContextManager._subsitution_manager_types  # (one list, kept)
    saved = list(types)
    types.clear()
    _Counting.log = []
    yield types
    types[:] = saved


def test_upstream_module_path_is_the_registry():
    assert poptorch._poplar_executor._OverwriteContextManager is _OverwriteContextManager


def test_managers_enter_in_order_and_leave_in_reverse(registry):
    _OverwriteContextManager.registerSubsitutionManager(_First)
    _OverwriteContextManager.registerSubsitutionManager(_Second)
    _OverwriteContextManager.registerSubsitutionManager(_First)  # once only
    assert registry == [_First, _Second]
    poptorch.inferenceModel(_Recorder())(torch.ones(1))
    calls = _Counting.log
    assert calls[:2] == [("replace", "_First"), ("replace", "_Second")]
    assert calls[2:4] == [("restore", "_Second"), ("restore", "_First")]
    assert len(calls) % 4 == 0  # every call (compiling included) replaces and restores


def test_compiling_without_running_also_enters_the_managers(registry):
    """``compile()`` may trace the model (PopTorch's does), so it is covered too."""
    _OverwriteContextManager.registerSubsitutionManager(_First)
    poptorch.inferenceModel(_Recorder()).compile(torch.ones(1))
    assert _Counting.log[:1] == [("replace", "_First")]
    assert _Counting.log[-1:] == [("restore", "_First")]
    assert len(_Counting.log) % 2 == 0


def test_nested_entries_replace_once(registry):
    _OverwriteContextManager.registerSubsitutionManager(_First)
    with substitutions():
        with substitutions():
            assert _overrides.substitutions_active()
        assert _Counting.log == [("replace", "_First")]
    assert _Counting.log == [("replace", "_First"), ("restore", "_First")]
    assert not _overrides.substitutions_active()


def test_a_failing_replace_restores_the_others(registry):
    _OverwriteContextManager.registerSubsitutionManager(_First)
    _OverwriteContextManager.registerSubsitutionManager(_Broken)
    with pytest.raises(KeyError, match="cannot replace"), substitutions():
        pass
    assert _Counting.log == [("replace", "_First"), ("restore", "_First")]
    assert not _overrides.substitutions_active()


def test_nothing_registered_costs_a_null_context(registry):
    assert isinstance(substitutions(), contextlib.nullcontext)


@pytest.mark.parametrize("bad,match", [
    (_First(), "expected a class"),
    (int, "has no replace / restore method"),
])
def test_registering_something_else_is_refused(registry, bad, match):
    with pytest.raises(poptorch.Error, match=match):
        _OverwriteContextManager.registerSubsitutionManager(bad)
    assert registry == []
