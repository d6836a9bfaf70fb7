"""``data.keys`` both as PyG 2.8's method and as the property of the PyG versions
PopTorch Geometric 3.4's programs were written for (poptorch_geometric.compat)."""
from __future__ import annotations

import pytest
import torch

pyg = pytest.importorskip("torch_geometric")
from torch_geometric.data import Batch, Data, HeteroData  # noqa: E402
from torch_geometric.data.data import BaseData  # noqa: E402

import poptorch_geometric  # noqa: E402, F401  (installs the compatibility)
from poptorch_geometric import compat  # noqa: E402


def test_keys_read_as_a_property_and_called_as_a_method():
    data = Data(x=torch.randn(3, 2), edge_index=torch.tensor([[0, 1], [1, 2]]), name="g")
    expected = BaseData.keys(data)  # PyG's own method, through the class
    assert sorted(expected) == ["edge_index", "name", "x"]
    assert data.keys() == expected and list(data.keys) == expected
    assert "x" in data.keys and data.keys == Data(**data.to_dict()).keys
    hetero = HeteroData()
    hetero["a"].x = torch.randn(2, 1)
    hetero.y = torch.ones(1)
    assert sorted(hetero.keys) == sorted(hetero.keys()) == ["x", "y"]
    batch = Batch.from_data_list([data, data])  # PyG itself calls keys()
    assert set(batch.keys) == {"x", "edge_index", "name", "batch", "ptr"}
    assert [d.num_nodes for d in batch.to_data_list()] == [3, 3]
    assert set(data.subgraph(torch.tensor([0, 1])).keys()) == set(expected)


def test_uninstall_gives_pyg_its_method_back():
    data = Data(x=torch.randn(2, 2))
    compat.uninstall()
    try:
        assert callable(data.keys) and not isinstance(data.keys, list)
        assert data.keys() == ["x"]
    finally:
        compat.install()
    assert isinstance(data.keys, list) and data.keys() == ["x"]
    compat.install()  # twice changes nothing
    assert data.keys() == ["x"]
