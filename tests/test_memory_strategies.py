"""Weights, accumulators and optimizer state sharded over the processes (RTS) and / or off
chip for the execution strategies (``_runtime/memory/step_shards.py``): torchrun
``--nproc_per_node=2`` (gloo, one thread each) on tests/strategy_shards_worker.py, a
two-block model pipelined and serial-phased, compared with the unsharded run and a
plain PyTorch loop over the same global batches. (The unsplit model: FSDP2,
tests/test_memory_distributed.py.)
"""
from __future__ import annotations

import pathlib

import pytest
import torch

from _memory_cases import CALLS, STRATEGY_G, make_model, plain_reference, strategy_cases
from test_memory_distributed import _max_diff, _state_diff, _torchrun

TOL = 1e-6
STRATEGIES = ("pipelined", "phased")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("strategy_shards")
    _torchrun("strategy_shards_worker.py", out, timeout=420)

    def load(strategy: str, name: str) -> list:
        return [torch.load(out / f"{strategy}_{name}_rank{rank}.pt", weights_only=False)
                for rank in (0, 1)]
    return load


@pytest.fixture(scope="module")
def reference() -> dict:
    return plain_reference(make_model(1000), range(CALLS), 2 * STRATEGY_G)


@pytest.mark.parametrize("name", [n for n in strategy_cases() if n != "plain"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_strategy_trains_as_plain_pytorch(runs, reference, strategy, name):
    """{weights, accumulators, optimizer} x {RTS, off chip, both}, and all three with
    both on the eager and the requested compiled backend: the weights of a plain
    PyTorch loop over the global batches and of the unsharded run (1e-6), the same
    optimizer state as the unsharded run, on both processes. A strategy's stages run
    eagerly whatever the backend asked for (model parallelism is not compiled), so the
    compiled case runs the eager backend too, and says so."""
    kinds, rts, _, backend = strategy_cases()[name]
    sharded_weights = rts and bool({"weight", "accumulator"} & set(kinds))
    unsharded = runs(strategy, "plain")
    for rank, run in enumerate(runs(strategy, name)):
        assert _max_diff(run["weights"], reference) <= TOL
        assert _max_diff(run["weights"], unsharded[rank]["weights"]) <= TOL
        assert _state_diff(run["state_dict"], unsharded[0]["state_dict"]) <= TOL
        assert run["backend"] == "eager"
        if sharded_weights:
            # between steps each process holds half of the sharded weights
            assert [held for held, _ in run["held"]] == [run["whole_weight_bytes"] // 2] * CALLS
            assert all(released for _, released in run["held"])


def test_unsharded_strategy_holds_whole_weights(runs):
    """Without RTS of weights or accumulators nothing is dropped between steps."""
    for strategy in STRATEGIES:
        for name in ("plain", "optimizer_rts", "weight_offchip"):
            for run in runs(strategy, name):
                assert all(held is None for held in run["held"])


def test_dropped_weights_are_gathered_before_a_read(runs):
    """The state dicts the worker read after training (through the module's access
    hook) are whole tensors of the model's shapes on both processes."""
    shapes = {k: v.shape for k, v in make_model(0).state_dict().items()}
    for strategy in STRATEGIES:
        for run in runs(strategy, "all_both"):
            assert {k: v.shape for k, v in run["weights"].items()} == shapes
