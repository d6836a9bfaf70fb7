"""Models that are ``torch.fx.GraphModule``s wrap, train and sync weights like any module.

The model is traced with ``torch.fx.symbolic_trace`` and its graph rewritten so that it
no longer calls one of its submodules (``sum_aggr``), as PyG's ``to_fixed_size`` does:
the submodule stays in the module tree, and ``copy.copy`` of a ``GraphModule`` (which
rebuilds it from its graph) would drop it. Each test runs the same model with poptorch
and with plain PyTorch, from the same seed and data.
"""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import poptorch

STEPS = 4


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 8)
        self.norm = nn.BatchNorm1d(8)
        self.sum_aggr = nn.Linear(8, 8)  # bypassed once the graph is rewritten
        self.out = nn.Linear(8, 3)

    def forward(self, x, target):
        out = self.out(self.sum_aggr(self.norm(self.lin(x))))
        return out, F.cross_entropy(out, target)


def traced_without_sum_aggr(seed=0):
    """``symbolic_trace(Net())`` whose graph calls ``torch.relu`` instead of
    ``sum_aggr``; the submodule (with its parameters) is still in the module tree."""
    torch.manual_seed(seed)
    gm = torch.fx.symbolic_trace(Net())
    for node in list(gm.graph.nodes):
        if node.op == "call_module" and node.target == "sum_aggr":
            with gm.graph.inserting_after(node):
                relu = gm.graph.call_function(torch.relu, node.args)
            node.replace_all_uses_with(relu)
            gm.graph.erase_node(node)
    gm.recompile()
    assert "sum_aggr" in dict(gm.named_modules())
    assert "sum_aggr" not in dict(copy.copy(gm).named_modules())  # what upstream's copy does
    return gm


def data(step, rows=8):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(rows, 6, generator=g), torch.randint(0, 3, (rows,), generator=g)


def state(module):
    return {**dict(module.named_parameters()), **dict(module.named_buffers())}


def max_diff(a, b):
    sa, sb = state(a), state(b)
    assert sa.keys() == sb.keys()
    return max((sa[k].detach().float() - sb[k].detach().float()).abs().max().item()
               for k in sa)


@pytest.mark.parametrize("device_iterations", [1, 2])
def test_fx_graph_module_trains_with_momentum_like_plain_pytorch(device_iterations):
    gm = traced_without_sum_aggr()
    reference = traced_without_sum_aggr()
    assert max_diff(gm, reference) == 0.0
    bypassed = gm.sum_aggr.weight.detach().clone()
    opts = poptorch.Options().deviceIterations(device_iterations)
    pop = poptorch.trainingModel(
        gm, opts, torch.optim.SGD(gm.parameters(), lr=0.1, momentum=0.9))
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        x, y = data(step, rows=8 * device_iterations)
        _, loss = pop(x, y)
        for xs, ys in zip(x.chunk(device_iterations), y.chunk(device_iterations),
                          strict=True):
            ref_opt.zero_grad()
            _, ref_loss = reference(xs, ys)
            ref_loss.backward()
            ref_opt.step()
        assert torch.allclose(loss.reshape(-1)[-1], ref_loss.detach(), atol=1e-6)
        # the user's GraphModule holds the trained weights and statistics
        assert max_diff(gm, reference) <= 1e-6
    assert torch.equal(gm.sum_aggr.weight, bypassed)  # no gradient: left as it was
    assert max_diff(pop.model, reference) <= 1e-6


def test_fx_graph_module_inference_matches_plain_pytorch():
    gm = traced_without_sum_aggr()
    reference = traced_without_sum_aggr().eval()
    pop = poptorch.inferenceModel(gm)
    for step in range(2):
        x, y = data(step)
        out, loss = pop(x, y)
        ref_out, ref_loss = reference(x, y)
        assert torch.allclose(out, ref_out, atol=1e-6)
        assert torch.allclose(loss, ref_loss, atol=1e-6)


def test_fx_graph_module_keeps_its_forward_hooks_and_attributes():
    # GraphModule.__copy__ drops hooks and attributes set on the instance; the
    # executor's copy keeps both, as for any module.
    gm = traced_without_sum_aggr()
    gm.scale = 3.0
    gm.register_forward_hook(lambda module, args, out: (out[0] * module.scale, out[1]))
    reference = traced_without_sum_aggr().eval()
    x, y = data(0)
    out, _ = poptorch.inferenceModel(gm)(x, y)
    assert torch.allclose(out, reference(x, y)[0] * 3.0, atol=1e-6)


def test_module_pairs_follow_the_copy_when_it_renames_or_drops_submodules():
    from poptorch._runtime.weights.modelcopy import iter_module_pairs
    original = Net()
    copied = copy.copy(original)
    copied._modules = {"renamed": original.lin, "out": original.out, "new": nn.ReLU()}
    pairs = [(o, c) for o, c in iter_module_pairs(original, copied)]
    assert pairs[0] == (original, copied)
    assert (original.lin, original.lin) in pairs  # found under its new name
    assert (original.out, original.out) in pairs
    assert (copied.new, copied.new) in pairs  # the copy's own module: paired with itself
    assert all(o is not original.sum_aggr for o, _ in pairs)  # dropped by the copy
