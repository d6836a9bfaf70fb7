"""PopTorch Geometric's static-shape point ops against brute-force plain-torch references.

Each reference walks the points one by one (distances to every point of the same
example, sorted), so it shares nothing with the ops' dense masked ``topk``. Points are
random floats: no two distances tie.
"""
from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("torch_geometric")

import poptorch
from poptorch_geometric import ops
from poptorch_geometric.ops._points import OpArgumentError


def _neighbours(x, y, i, batch_x, batch_y, limit, within=None, exclude=None, cosine=False):
    """Indexes of x nearest to y[i] in y[i]'s example, nearest first (at most ``limit``)."""
    found = []
    for j in range(x.shape[0]):
        if int(batch_x[j]) != int(batch_y[i]) or j == exclude:
            continue
        if cosine:
            d = 1.0 - float(torch.dot(x[j], y[i]) / (x[j].norm() * y[i].norm()))
        else:
            d = float(((x[j].double() - y[i].double()) ** 2).sum().sqrt())
        if within is None or d <= within:
            found.append((d, j))
    return [j for _, j in sorted(found)[:limit]]


def _slots_reference(x, y, batch_x, batch_y, slots, **kwargs):
    """[2, M * slots]: (query, neighbour) pairs, nearest first, -1 pairs for empty slots."""
    rows, cols = [], []
    for i in range(y.shape[0]):
        found = _neighbours(x, y, i, batch_x, batch_y, slots, **kwargs)
        rows += [i] * len(found) + [-1] * (slots - len(found))
        cols += found + [-1] * (slots - len(found))
    return torch.tensor([rows, cols])


def _graph_reference(x, batch, slots, loop, flow, within=None):
    rows, cols = [], []
    for i in range(x.shape[0]):
        found = _neighbours(x, x, i, batch, batch, slots, within=within,
                            exclude=None if loop else i)
        rows += [i] * len(found) + [-1] * (slots - len(found))
        cols += found + [-1] * (slots - len(found))
    center, neighbour = torch.tensor(rows), torch.tensor(cols)
    if flow == "source_to_target":
        return torch.stack([neighbour, center])
    return torch.stack([center, neighbour])


class _Call(torch.nn.Module):
    """Runs ``op`` as a model, so that it goes through a PopTorch executor."""

    def __init__(self, op, **kwargs):
        super().__init__()
        self.op, self.kwargs = op, kwargs

    def forward(self, *args):
        return self.op(*args, **self.kwargs)


@pytest.fixture
def clouds():
    torch.manual_seed(5)
    x = torch.randn(23, 3)
    y = torch.randn(11, 3)
    # unsorted example indexes; example 2 has only 3 points in x (fewer than k below)
    batch_x = torch.tensor([0] * 10 + [1] * 10 + [2] * 3)[torch.randperm(23)]
    batch_y = torch.tensor([0, 1, 2, 0, 1, 2, 0, 1, 2, 1, 0])
    return x, y, batch_x, batch_y


@pytest.mark.parametrize("cosine", [False, True])
def test_knn_matches_brute_force_with_padding(clouds, cosine):
    x, y, batch_x, batch_y = clouds
    got = ops.knn(x, y, 5, batch_x, batch_y, cosine=cosine)
    assert got.dtype == torch.long and got.shape == (2, 11 * 5)
    assert torch.equal(got, _slots_reference(x, y, batch_x, batch_y, 5, cosine=cosine))
    # example 2 has 3 points: two empty slots (both rows -1) for each of its queries
    assert int((got[1] == -1).sum()) == 2 * int((batch_y == 2).sum())


def test_knn_without_batches_and_with_k_above_the_point_count():
    torch.manual_seed(1)
    x, y = torch.randn(4, 2), torch.randn(3, 2)
    zeros_x, zeros_y = torch.zeros(4, dtype=torch.long), torch.zeros(3, dtype=torch.long)
    got = ops.knn(x, y, 6)
    assert got.shape == (2, 18)
    assert torch.equal(got, _slots_reference(x, y, zeros_x, zeros_y, 6))
    # 1-D points are points on a line; float batch vectors are example indexes
    line_x, line_y = torch.tensor([0.0, 5.0, 1.0, 9.0]), torch.tensor([4.0, 8.5])
    got = ops.knn(line_x, line_y, 2, torch.tensor([0.0, 0, 1, 1]), torch.tensor([0.0, 1]))
    assert got.tolist() == [[0, 0, 1, 1], [1, 0, 3, 2]]


@pytest.mark.parametrize("loop", [True, False])
@pytest.mark.parametrize("flow", ["source_to_target", "target_to_source"])
def test_knn_graph_matches_brute_force(clouds, loop, flow):
    x, _, batch_x, _ = clouds
    got = ops.knn_graph(x, 4, batch_x, loop=loop, flow=flow)
    assert got.shape == (2, 23 * 4)
    assert torch.equal(got, _graph_reference(x, batch_x, 4, loop, flow))
    if not loop:
        assert not bool(((got[0] == got[1]) & (got[0] >= 0)).any())


def test_radius_matches_brute_force(clouds):
    x, y, batch_x, batch_y = clouds
    for r, slots in [(1.2, 32), (1.5, 3), (0.0, 2)]:
        got = ops.radius(x, y, r, batch_x, batch_y, max_num_neighbors=slots)
        assert got.shape == (2, 11 * slots)
        assert torch.equal(got, _slots_reference(x, y, batch_x, batch_y, slots, within=r))
    # integer coordinates are accepted (as points)
    grid = torch.tensor([[0, 0], [0, 1], [3, 3]])
    assert ops.radius(grid, grid[:1], 1, max_num_neighbors=3).tolist() == \
        [[0, 0, -1], [0, 1, -1]]


@pytest.mark.parametrize("loop", [True, False])
@pytest.mark.parametrize("flow", ["source_to_target", "target_to_source"])
def test_radius_graph_matches_brute_force(clouds, loop, flow):
    x, _, batch_x, _ = clouds
    got = ops.radius_graph(x, 1.4, batch_x, loop=loop, max_num_neighbors=6, flow=flow)
    assert got.shape == (2, 23 * 6)
    assert torch.equal(got, _graph_reference(x, batch_x, 6, loop, flow, within=1.4))


def test_knn_interpolate_matches_the_formula(clouds):
    x_pos, y_pos, batch_x, batch_y = clouds
    torch.manual_seed(2)
    features = torch.randn(23, 4, requires_grad=True)
    got = ops.knn_interpolate(features, x_pos, y_pos, batch_x, batch_y, k=4)
    rows = []
    for i in range(11):
        near = _neighbours(x_pos, y_pos, i, batch_x, batch_y, 4)
        weights = torch.stack([1.0 / ((x_pos[j] - y_pos[i]) ** 2).sum() for j in near])
        rows.append((weights[:, None] * features[near]).sum(0) / weights.sum())
    reference = torch.stack(rows)
    torch.testing.assert_close(got, reference)
    # gradients flow into the features, the weights are constants
    got.sum().backward()
    grad = features.grad.clone()
    features.grad = None
    reference.sum().backward()
    torch.testing.assert_close(grad, features.grad)


def _fps_reference(points, batch, ratio, first=0):
    out = []
    for example in sorted(set(batch.tolist())):
        members = [i for i in range(points.shape[0]) if int(batch[i]) == example]
        chosen = [members[first]]
        while len(chosen) < math.ceil(ratio * len(members)):
            far = max(members, key=lambda i: min(float(((points[i] - points[c]) ** 2).sum())
                                                 for c in chosen))
            chosen.append(far)
        out += chosen
    return out


def test_fps_takes_pyg_batch_vectors():
    torch.manual_seed(4)
    points = torch.randn(15, 3)
    batch = torch.tensor([0] * 6 + [1] * 9)
    got = ops.fps(points, batch, ratio=0.5, random_start=False)
    assert got.tolist() == _fps_reference(points, batch, 0.5)
    assert ops.fps(points, None, torch.tensor(0.25), random_start=False).tolist() == \
        _fps_reference(points, torch.zeros(15, dtype=torch.long), 0.25)
    with pytest.raises(OpArgumentError, match="sorted"):
        ops.fps(points, batch.flip(0), 0.5)


@pytest.mark.parametrize("op,args,kwargs", [
    (ops.knn, "x y", {"k": 3}),
    (ops.knn_graph, "x", {"k": 3, "loop": True}),
    (ops.radius, "x y", {"r": 1.3, "max_num_neighbors": 4}),
    (ops.radius_graph, "x", {"r": 1.3, "max_num_neighbors": 4}),
])
def test_ops_inside_a_model_match_the_eager_op(clouds, op, args, kwargs):
    x, y, _, _ = clouds
    inputs = [x] if args == "x" else [x, y]
    model = poptorch.inferenceModel(_Call(op, **kwargs))
    expected = op(*inputs, **kwargs)
    for _ in range(2):  # compiling call and a later one
        assert torch.equal(model(*inputs), expected)
    assert torch.equal(model(*[t * 2 for t in inputs]), op(*[t * 2 for t in inputs], **kwargs))


def test_knn_interpolate_trains_inside_a_model(clouds):
    x_pos, y_pos, batch_x, batch_y = clouds
    torch.manual_seed(0)

    class Interpolate(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(3, 4)

        def forward(self, pos_x, pos_y, bx, by):
            out = ops.knn_interpolate(self.lin(pos_x), pos_x, pos_y, bx, by, k=3)
            return out, (out ** 2).mean()

    model = Interpolate()
    reference = Interpolate()
    reference.load_state_dict(model.state_dict())
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    training = poptorch.trainingModel(model, optimizer=poptorch.optim.SGD(
        model.parameters(), lr=0.1))
    for _ in range(2):
        out, loss = training(x_pos, y_pos, batch_x, batch_y)
        optimizer.zero_grad()
        ref_out, ref_loss = reference(x_pos, y_pos, batch_x, batch_y)
        ref_loss.backward()
        optimizer.step()
        torch.testing.assert_close(out, ref_out.detach())
        torch.testing.assert_close(loss, ref_loss.detach())
    training.copyWeightsToHost()
    torch.testing.assert_close(model.lin.weight, reference.lin.weight)


@pytest.mark.parametrize("call,match", [
    (lambda x: ops.knn(x, x, 0), "k must be an int >= 1"),
    (lambda x: ops.knn(x, x, True), "k must be an int >= 1"),
    (lambda x: ops.knn(x, x[:, :2], 2), "same number of features"),
    (lambda x: ops.knn(x, x, 2, torch.zeros(3)), "one example index per point"),
    (lambda x: ops.knn_graph(x, 2, flow="up"), "flow must be"),
    (lambda x: ops.radius(x, x, -1.0), "r must be a number >= 0"),
    (lambda x: ops.radius_graph(x, 1.0, max_num_neighbors=0), "max_num_neighbors"),
    (lambda x: ops.knn([[0.0]], x, 1), "must be a tensor of points"),
    (lambda x: ops.knn_interpolate(x[:3], x, x), "one row of features per point"),
])
def test_bad_arguments_raise_clear_errors(call, match):
    x = torch.randn(5, 3)
    with pytest.raises(OpArgumentError, match=match) as info:
        call(x)
    assert isinstance(info.value, poptorch.Error) and isinstance(info.value, ValueError)


def test_nearest_argument_errors_are_value_errors_as_in_torch_cluster():
    x, y = torch.randn(8, 2), torch.randn(4, 2)
    for batch_x, batch_y in [([0, 0, 0, 0, 1, 1, 1, 1], [0, 0, 0, 0]),
                             ([0, 0, 1, 0, 0, 0, 0, 0], [0, 0, 1, 1])]:
        with pytest.raises(ValueError):
            poptorch.nearest(x, y, batch_x, batch_y)
    with pytest.raises(poptorch.Error, match="one entry per point"):
        poptorch.nearest(x, y, [0] * 7, [0] * 4)
