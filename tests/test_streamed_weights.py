"""Weights off chip in one process (``_runtime/memory/streamed_weights.py``): in host
memory between steps, streamed to the device block by block. On the CPU host memory is
the device's, so the tests set ``fsdp.force_stream``: the weights then live in host
copies of their own and every move is a real copy, as on a GPU.
"""
from __future__ import annotations

import copy

import pytest
import torch

import poptorch
from poptorch._runtime.memory import fsdp
from poptorch._runtime.memory.streamed_weights import StreamedWeights
from _memory_cases import Blocks

G = 2
ROWS = 4


@pytest.fixture(autouse=True)
def _own_log_once_keys(monkeypatch):
    """The INFO lines logged once here do not count as logged for later tests."""
    monkeypatch.setattr(poptorch._logging, "_once_keys", set())


@pytest.fixture
def streaming(monkeypatch):
    monkeypatch.setattr(fsdp, "force_stream", True)


def _options(optimizer_off_chip: bool = False, backend: str | None = None
             ) -> poptorch.Options:
    opts = poptorch.Options()
    opts.Training.gradientAccumulation(G)
    opts.TensorLocations.setWeightLocation(
        poptorch.TensorLocationSettings().useOnChipStorage(False))
    if optimizer_off_chip:
        opts.TensorLocations.setOptimizerLocation(
            poptorch.TensorLocationSettings().useOnChipStorage(False))
    opts.Jit.backend(backend)
    return opts


def _batch(call: int) -> torch.Tensor:
    return torch.randn(G * ROWS, 16, generator=torch.Generator().manual_seed(call))


def _reference(model: torch.nn.Module, calls: int) -> dict:
    """Plain PyTorch: one AdamW step per call on the mean of its micro-batches' losses."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    for call in range(calls):
        x = _batch(call)
        optimizer.zero_grad()
        loss = sum(model(x[k * ROWS:(k + 1) * ROWS])[1] for k in range(G)) / G
        loss.backward()
        optimizer.step()
    return copy.deepcopy(model.state_dict())


def _streamed(training: poptorch.PoplarExecutor) -> StreamedWeights:
    found = [w for w in training._compiled.program.spec.wrappers
             if isinstance(w, StreamedWeights)]
    assert len(found) == 1
    return found[0]


def _max_diff(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in b)


@pytest.mark.parametrize("optimizer_off_chip", [False, True])
@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_streamed_weights_train_as_plain_pytorch(streaming, optimizer_off_chip, backend):
    """8 blocks, 2 micro-batches per step, 3 steps: the weights of a plain PyTorch loop
    (1e-6), read through the module between steps; with the optimizer state off chip
    too; asked for the compiled backend, the calls run eagerly (the blocks' hooks move
    the weights), so the same within 1e-6."""
    torch.manual_seed(0)
    model = Blocks()
    reference = _reference(copy.deepcopy(model), 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    training = poptorch.trainingModel(model, _options(optimizer_off_chip, backend),
                                      optimizer)
    for call in range(3):
        training(_batch(call))
    assert _max_diff(model.state_dict(), reference) <= 1e-6
    assert training.backendInUse == "eager"
    streamed = _streamed(training)
    assert len(streamed.params) == 8 and all(len(group) == 2 for group in streamed.params)


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")
def test_at_most_two_blocks_on_the_device(streaming):
    """The runtime's accounting, and independently hooks on the blocks: at every block's
    forward and backward at most 2 blocks have weights outside their host copies; after
    a call every weight is its host copy again."""
    torch.manual_seed(1)
    model = Blocks()
    training = poptorch.trainingModel(model, _options(),
                                      torch.optim.SGD(model.parameters(), lr=0.1))
    training(_batch(0))  # (the first call builds the program; weights now in host copies)
    host = {id(p): p.data.untyped_storage().data_ptr() for p in model.parameters()}

    def on_device(block: torch.nn.Module) -> bool:
        return any(p.data.untyped_storage().nbytes() > 0
                   and p.data.untyped_storage().data_ptr() != host[id(p)]
                   for p in block.parameters())

    seen: list[int] = []

    def count(*_):
        seen.append(sum(on_device(b) for b in model.blocks))

    for block in model.blocks:
        block.register_forward_hook(count)
        block.register_full_backward_hook(count)
    training(_batch(1))
    assert len(seen) == 2 * G * 8
    assert max(seen) <= 2 and max(seen) >= 1
    assert _streamed(training).peak_loaded == 2
    assert not any(on_device(b) for b in model.blocks)


def test_streamed_inference_equals_plain_pytorch(streaming):
    """An inference model streams its blocks too: outputs of plain PyTorch."""
    torch.manual_seed(2)
    model = Blocks().eval()
    reference = copy.deepcopy(model)
    opts = poptorch.Options()
    opts.TensorLocations.setWeightLocation(
        poptorch.TensorLocationSettings().useOnChipStorage(False))
    inference = poptorch.inferenceModel(model, opts)
    x = _batch(3)[:ROWS]
    out, loss = inference(x)
    expected, expected_loss = reference(x)
    assert torch.allclose(out, expected, atol=1e-6)
    assert _streamed(inference).peak_loaded == 2


def test_a_weight_shared_by_two_blocks_stays_on_the_device(streaming):
    """Tied weights (one parameter in two blocks) are not streamed; the rest is, and the
    model trains as plain PyTorch."""
    torch.manual_seed(4)
    model = Blocks(n=3)
    model.blocks[2].weight = model.blocks[0].weight
    reference = _reference(copy.deepcopy(model), 2)
    training = poptorch.trainingModel(model, _options(),
                                      torch.optim.AdamW(model.parameters(), lr=0.01))
    for call in range(2):
        training(_batch(call))
    assert _max_diff(model.state_dict(), reference) <= 1e-6
    streamed = _streamed(training)
    assert [len(group) for group in streamed.params] == [1, 2, 1]


def test_weights_off_chip_on_the_cpu_change_nothing_without_force_stream():
    """On the CPU, without the test switch, nothing streams (logged once at INFO)."""
    model = Blocks(n=2)
    training = poptorch.trainingModel(model, _options(),
                                      torch.optim.SGD(model.parameters(), lr=0.1))
    training(_batch(0))
    assert not [w for w in training._compiled.program.spec.wrappers
                if isinstance(w, StreamedWeights)]


def test_destroy_gives_back_a_plain_module(streaming):
    """Once the program is destroyed its hooks are off the blocks and the module runs
    as plain PyTorch: a forward and backward of a copy of its weights agree."""
    torch.manual_seed(5)
    model = Blocks(n=3)
    training = poptorch.trainingModel(model, _options(),
                                      torch.optim.SGD(model.parameters(), lr=0.1))
    training(_batch(0))
    training.destroy()
    assert not any(b._forward_hooks or b._forward_pre_hooks for b in model.blocks)
    model.zero_grad(set_to_none=True)  # (the last update's gradients)
    reference = copy.deepcopy(model)
    x = _batch(1)[:ROWS]
    loss, expected = model(x)[1], reference(x)[1]
    loss.backward()
    expected.backward()
    assert torch.equal(loss, expected)
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)
