"""Replicated tensor sharding and off-chip storage of the optimizer state in one process
(``_runtime/memory/``): two local replicas share each tensor's state; the results equal
the unsharded run and a plain PyTorch loop."""
from __future__ import annotations

import logging

import pytest
import torch

import poptorch
from poptorch._runtime.memory import sharding
from poptorch._runtime.memory.layout import balanced_ranges, plan_layout
from poptorch._runtime.memory.offload import StateStorage, chunks
from poptorch.enums import CommGroupType
from _memory_cases import (CALLS, Grouped, adamw, elementwise_state_bytes, global_batch,
                           make_model, options, plain_reference, train, train_grouped)

TOL = 1e-6


def _diff(a: dict, b: dict) -> float:
    return max((a[k].float() - b[k].float()).abs().max().item() for k in b)


def _state_diff(a: dict, b: dict) -> float:
    assert a["state"].keys() == b["state"].keys()
    return max((a["state"][i][k].float() - v.float()).abs().max().item()
               for i in b["state"] for k, v in b["state"][i].items())


def _weights(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_two_local_replicas_equal_unsharded_and_plain_pytorch():
    results = {}
    for sharded in (False, True):
        model = make_model()
        optimizer = adamw(model)
        training = train(model, options(2, sharded), optimizer, range(CALLS), 2)
        managed = training._program.managed_step
        assert (managed is not None) == sharded
        results[sharded] = (_weights(model), optimizer.state_dict())
    reference = plain_reference(make_model(), range(CALLS), 2)
    assert _diff(results[True][0], results[False][0]) <= TOL
    assert _diff(results[True][0], reference) <= TOL
    assert _state_diff(results[True][1], results[False][1]) <= TOL
    assert results[True][1]["ipu_state"].keys() == results[False][1]["ipu_state"].keys()


def test_pieces_are_held_by_the_step_and_gathered_for_state_dict():
    model = make_model()
    optimizer = adamw(model)
    training = train(model, options(2, True), optimizer, range(2), 2)
    managed = training._program.managed_step
    assert not any(optimizer.state.values())  # nothing whole between steps
    # fc1.weight (40) and fc2.weight (24) end to end, cut in two ranges of 32: replica 0
    # holds fc1.weight[:32], replica 1 fc1.weight[32:] and fc2.weight; the biases whole
    # (both local replicas' pieces are in this process: the same bytes in all)
    shapes = sorted(tuple(e["exp_avg"].shape) for e in managed.state.values())
    assert shapes == sorted([(3,), (8,), (8,), (24,), (32,)])
    state = optimizer.state_dict()
    assert [tuple(state["state"][i]["exp_avg"].shape) for i in range(4)] == \
        [(8, 5), (8,), (3, 8), (3,)]
    assert elementwise_state_bytes(optimizer.state) == managed.local_state_bytes() - 4 * 5


@pytest.mark.parametrize("min_elements,sharded_names", [
    (24, ["fc1.weight", "fc2.weight"]),   # 24 elements: at least the threshold
    (25, ["fc1.weight"]),
    (41, [])])
def test_min_elements_threshold(min_elements, sharded_names):
    model = make_model()
    optimizer = adamw(model)
    training = train(model, options(2, True, min_elements), optimizer, range(1), 2)
    managed = training._program.managed_step
    names = [n for n, _ in model.named_parameters()]
    if not sharded_names:
        assert managed is None
        return
    assert sorted({names[q.param] for q in managed.layout.pieces}) == sorted(sharded_names)
    assert sorted(names[i] for i in managed.layout.replicated) == \
        sorted(set(names) - set(sharded_names))


@pytest.mark.parametrize("make_optimizer,plain", [
    (lambda p: poptorch.optim.SGD(p, lr=0.1, momentum=0.9, velocity_scaling=8.0,
                                  loss_scaling=8.0, use_combined_accum=True),
     lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)),
    (lambda p: poptorch.optim.RMSprop(p, lr=0.01, momentum=0.5),
     lambda p: torch.optim.RMSprop(p, lr=0.01, momentum=0.5)),
    (lambda p: torch.optim.Adam(p, lr=0.05), lambda p: torch.optim.Adam(p, lr=0.05)),
    (lambda p: poptorch.optim.LAMB(p, lr=0.05), None),
    (lambda p: poptorch.optim.AdamW(p, lr=0.05, accum_type=torch.float16,
                                    first_order_momentum_accum_type=torch.float16), None)])
def test_other_optimizers_equal_unsharded(make_optimizer, plain):
    """Elementwise optimizers shard piece by piece, LAMB (a norm per tensor) tensor by
    tensor; velocity / loss scaling and accumulator dtypes are the optimizer's own."""
    results = []
    for sharded in (False, True):
        model = make_model()
        optimizer = make_optimizer(model.parameters())
        train(model, options(2, sharded), optimizer, range(CALLS), 2)
        results.append((_weights(model), optimizer.state_dict()))
    assert _diff(results[1][0], results[0][0]) <= TOL
    assert _state_diff(results[1][1], results[0][1]) <= TOL
    for i, entry in results[0][1]["state"].items():
        for key, value in entry.items():
            assert results[1][1]["state"][i][key].dtype == value.dtype
    if plain is not None:
        model = make_model()
        optimizer = plain(model.parameters())
        for call in range(CALLS):
            optimizer.zero_grad()
            model(*global_batch(call, 2))[1].backward()
            optimizer.step()
        assert _diff(results[1][0], _weights(model)) <= TOL


def test_load_state_dict_and_set_optimizer_between_calls():
    """A state loaded mid-run is split into the pieces at the next step; setOptimizer
    keeps the pieces; both as without sharding."""
    results = []
    for sharded in (False, True):
        model = make_model()
        optimizer = adamw(model)
        training = train(model, options(2, sharded), optimizer, range(2), 2)
        saved = optimizer.state_dict()
        training(*global_batch(2, 2))
        optimizer.load_state_dict(saved)   # back to the state after two steps
        training(*global_batch(2, 2))
        training.setOptimizer(poptorch.optim.AdamW(model.parameters(), lr=0.01,
                                                   loss_scaling=4.0))
        training(*global_batch(3, 2))
        results.append((_weights(model), optimizer.state_dict()))
    assert _diff(results[1][0], results[0][0]) <= TOL


def test_replica_groups_in_one_process():
    """Four replicas, Consecutive groups of two: each group's slice is sharded over the
    group's replicas; equals the unsharded run."""
    weights = []
    for sharded in (False, True):
        model = Grouped(2)
        training, _ = train_grouped(model, 4, sharded, CommGroupType.Consecutive, 2)
        weights.append(model.W.detach().clone())
        if sharded:
            owners = [(q.start, q.end, q.owner) for q in training._program.managed_step.layout.pieces]
            assert owners == [(0, 10, 0), (10, 20, 1), (20, 30, 2), (30, 40, 3)]
    assert (weights[0] - weights[1]).abs().max().item() <= TOL


def test_off_chip_state_streams_through_host_copies(monkeypatch):
    """The moves of off-chip state (real on GPUs) forced on the CPU, in chunks of a few
    parameters: equal to the unsharded run, clipping over all chunks included."""
    monkeypatch.setattr(sharding, "OFFLOAD_CHUNK_ELEMENTS", 30)
    model = make_model()
    optimizer = adamw(model)
    training = train(model, options(2, True), optimizer, range(1), 2)
    managed = training._program.managed_step
    storage = StateStorage(True, min_elements=0, force_stream=True)
    fetched = []
    real_fetch = storage.fetch
    monkeypatch.setattr(storage, "fetch", lambda state, device: fetched.append(
        len(state)) or real_fetch(state, device))
    managed.storage = storage
    steps = []
    real_inner = managed.inner
    managed.inner = lambda: steps.append(1) or real_inner()
    for call in range(1, CALLS):
        training(*global_batch(call, 2))
    assert len(fetched) == 5 * (CALLS - 1)  # every piece's state, every step
    assert len(steps) > CALLS - 1          # several chunks per step
    reference = make_model()
    train(reference, options(2, False), adamw(reference), range(CALLS), 2)
    assert _diff(_weights(model), _weights(reference)) <= TOL
    sizes = [[t.numel() for t in c] for c in
             chunks([torch.zeros(10), torch.zeros(15), torch.zeros(50)], 30)]
    assert sizes == [[10, 15], [50]]


def test_off_chip_on_cpu_is_logged_once_and_changes_nothing(caplog):
    poptorch.setLogLevel("INFO")
    try:
        model = make_model()
        optimizer = adamw(model)
        opts = options(1, False, off_chip=True)
        opts.TensorLocations.setWeightLocation(
            poptorch.TensorLocationSettings().useReplicatedTensorSharding(True))
        with caplog.at_level(logging.INFO, logger="poptorch"):
            training = train(model, opts, optimizer, range(CALLS), 1)
        assert training._program.managed_step is None
        text = caplog.text
        assert "optimizer state off chip" in text and "changes nothing on the CPU" in text
        assert "replicated tensor sharding of weights is recorded" in text
    finally:
        poptorch.setLogLevel("WARN")
    reference = make_model()
    train(reference, options(1, False), adamw(reference), range(CALLS), 1)
    assert _diff(_weights(model), _weights(reference)) == 0.0


def test_layout_rules():
    assert balanced_ranges(10, 3) == [(0, 4), (4, 7), (7, 10)]
    params = [torch.zeros(10, requires_grad=True), torch.zeros(3, 4, requires_grad=True),
              torch.zeros(2, requires_grad=True), torch.zeros(50)]
    layout = plan_layout(params, min_elements=3, replicas_per_process=2, processes=2,
                         elementwise=True)
    assert layout.replicated == [2, 3]  # too small; not trained
    # 10 + 12 elements end to end, padded to 24: six per replica
    assert [(q.param, q.start, q.end, q.owner) for q in layout.local(0)] == \
        [(0, 0, 6, 0), (0, 6, 10, 1), (1, 0, 2, 1)]
    assert [(q.param, q.start, q.end, q.owner) for q in layout.local(1)] == \
        [(1, 2, 8, 2), (1, 8, 12, 3)]
    assert layout.process_range(layout.buckets[0], 1) == (12, 24)
    whole = plan_layout(params[:2], min_elements=3, replicas_per_process=1, processes=2,
                        elementwise=False)
    assert [(q.param, q.owner, q.whole) for q in whole.pieces] == [(0, 0, True), (1, 1, True)]


def test_activations_off_chip_wrapper_on_gpu_devices_only():
    """The wrapper is installed for an accelerator (a stand-in program; no GPU here) and
    not on the CPU; around a forward / backward it gives plain PyTorch's gradients, in
    the calling thread and in a worker thread (``thread_context``)."""
    import threading

    from poptorch._runtime.config import LocationsConfig
    from poptorch._runtime.memory.locations import install
    from poptorch._runtime.memory.offload import ActivationsOffChip
    opts = poptorch.Options()
    opts.TensorLocations.setActivationLocation(
        poptorch.TensorLocationSettings().useOnChipStorage(False))
    for device, expected in (("cuda", 1), ("cpu", 0)):
        effects = install(make_model(), LocationsConfig.of(opts), None,
                          torch.device(device), training=False, optimizer=lambda: None,
                          cross=None, replicas=1)
        assert effects.wrappers == ()  # (inference saves no activations)
        effects = install(make_model(), LocationsConfig.of(opts), None,
                          torch.device(device), training=True, optimizer=lambda: None,
                          cross=None, replicas=1)
        assert len(effects.wrappers) == expected and effects.managed_step is None
        assert all(isinstance(w, ActivationsOffChip) for w in effects.wrappers)
    wrapper = ActivationsOffChip()
    x, y = global_batch(0, 1)

    def grads(context) -> list:
        model = make_model()
        with context:
            model(x, y)[1].backward()
        return [p.grad for p in model.parameters()]
    import contextlib
    plain = grads(contextlib.nullcontext())
    for _ in range(2):  # entered once per call
        assert all(torch.equal(a, b) for a, b in zip(grads(wrapper), plain, strict=False))
    result = []
    thread = threading.Thread(target=lambda: result.append(grads(wrapper.thread_context())))
    thread.start()
    thread.join()
    assert all(torch.equal(a, b) for a, b in zip(result[0], plain, strict=False))


def test_a_program_compiled_again_keeps_the_sharded_state():
    """destroy() and a new first call compile again: the new program starts from the
    pieces of the previous one, as an unsharded program keeps the optimizer's state."""
    weights = []
    for sharded in (False, True):
        model = make_model()
        optimizer = adamw(model)
        training = train(model, options(2, sharded), optimizer, range(2), 2)
        training.destroy()
        for call in range(2, CALLS):
            training(*global_batch(call, 2))
        weights.append(_weights(model))
    assert _diff(weights[1], weights[0]) <= TOL
    assert _diff(weights[1], plain_reference(make_model(), range(CALLS), 2)) <= TOL
