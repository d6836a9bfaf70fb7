"""Refusals raise the class upstream PopTorch 3.4 raises, and are poptorch.Errors too.

Code written against upstream catches the built-in class upstream raised (an ``assert``
gives ``AssertionError``); code written against our documentation catches
``poptorch.Error``. Each case below is hit the way a user hits it, through the public
API, and must satisfy both. Upstream's facts used (from its 3.4 sources):

* a batch that is not a multiple of deviceIterations x replicas x gradientAccumulation:
  ``AssertionError`` (the executor's batch narrowing); an input group size that does not
  divide the replication factor: ``ValueError`` (``inputReplicaGrouping``);
* ``DataLoader``: ``batch_sampler`` with ``batch_size`` / ``shuffle``: ``poptorch.Error``;
  an ``IterableDataset`` with automatic distributed partitioning, ``rebatched_worker_size``
  above the combined batch size, ``rebatched_size`` in ``async_options`` with
  ``AsyncRebatched``, and options that are no ``Options``: ``AssertionError``; unknown
  ``async_options``: ``TypeError`` (the accessor's keyword arguments);
* ``poptorch.optim``: an accumulation type other than float16 / float32 and an unknown
  attribute given to ``variable_attrs.markAsConstant`` / ``markAsVariable``:
  ``AssertionError``; ``amsgrad=True``: ``ValueError``; an optimizer state it cannot
  load: ``RuntimeError``;
* blocks: ``BeginBlock`` of something not callable: ``poptorch.Error``; ``removeBlocks``
  of something that is no module: ``AssertionError``; ``recomputationCheckpoint`` of
  something that is no tensor: ``ValueError``.
"""
from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import poptorch
from poptorch import errors


def _raises(expected: type[BaseException], action: Callable[[], object],
            match: str | None = None) -> BaseException:
    """Run ``action``: it must raise ``expected`` and a ``poptorch.Error``."""
    with pytest.raises(expected, match=match) as info:
        action()
    assert isinstance(info.value, poptorch.Error), type(info.value).__mro__
    return info.value


# ------------------------------------------------------------------ the error classes
@pytest.mark.parametrize("cls,builtin", [
    (errors.PoptorchAssertionError, AssertionError),
    (errors.PoptorchValueError, ValueError),
    (errors.PoptorchTypeError, TypeError),
    (errors.PoptorchRuntimeError, RuntimeError),
    (errors.PoptorchAttributeError, AttributeError)])
def test_each_class_is_caught_both_ways(cls, builtin):
    for catch in (builtin, poptorch.Error):
        try:
            raise cls("what was wrong and how to fix it")
        except catch as exc:
            assert exc.message == str(exc) == "what was wrong and how to fix it"
            assert exc.type == "poptorch_error" and exc.location


# ------------------------------------------------------------------------ call path
def test_batch_not_a_multiple_of_the_factors_is_an_assertion():
    opts = poptorch.Options().deviceIterations(2)
    model = poptorch.inferenceModel(torch.nn.Linear(3, 2), opts)
    exc = _raises(AssertionError, lambda: model(torch.ones(3, 3)),
                  match=r"batch size 3.*deviceIterations \(2\)")
    assert "pass a batch of 2 or 4 rows" in str(exc)  # our message is kept
    assert model(torch.ones(4, 3)).shape == (4, 2)  # a fitting batch still runs


def test_training_batch_not_a_multiple_is_an_assertion():
    class WithLoss(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(3, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return poptorch.identity_loss(self.lin(x).sum(), reduction="none")

    opts = poptorch.Options()
    opts.Training.gradientAccumulation(3)
    model = poptorch.trainingModel(WithLoss(), opts,
                                   optimizer=torch.optim.SGD(WithLoss().parameters(), 0.1))
    _raises(AssertionError, lambda: model(torch.ones(4, 3)),
            match=r"gradientAccumulation \(3\)")


def test_input_group_that_does_not_divide_the_replicas_is_a_value_error():
    opts = poptorch.Options().replicationFactor(4)
    opts.inputReplicaGrouping(3, poptorch.CommGroupType.Consecutive)
    model = poptorch.inferenceModel(torch.nn.Linear(3, 2), opts)
    _raises(ValueError, lambda: model(torch.ones(4, 3)), match="must divide")


# ----------------------------------------------------------------------- DataLoader
class _Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(torch.arange(32, dtype=torch.float32).unsqueeze(1))


_DATA = torch.utils.data.TensorDataset(torch.arange(16, dtype=torch.float32))


def test_batch_sampler_with_batch_size_is_an_error():
    sampler = torch.utils.data.BatchSampler(torch.utils.data.SequentialSampler(_DATA), 2,
                                            drop_last=False)
    # upstream: poptorch.Error; earlier releases here: ValueError (both still caught)
    _raises(ValueError, lambda: poptorch.DataLoader(
        poptorch.Options(), _DATA, batch_size=2, batch_sampler=sampler),
        match="mutually exclusive")
    _raises(ValueError, lambda: poptorch.DataLoader(
        poptorch.Options(), _DATA, shuffle=True, batch_sampler=sampler))


def test_options_that_are_not_options_is_an_assertion():
    _raises(AssertionError, lambda: poptorch.DataLoader({"deviceIterations": 2}, _DATA),
            match="poptorch.Options")


def test_iterable_data_set_with_distributed_partitioning_is_an_assertion():
    opts = poptorch.Options()
    opts.Distributed.configureProcessId(0, 2)
    _raises(AssertionError, lambda: poptorch.DataLoader(opts, _Stream(), batch_size=2))


def test_rebatched_worker_size_above_the_combined_batch_is_an_assertion():
    opts = poptorch.Options().deviceIterations(2)
    _raises(AssertionError, lambda: poptorch.DataLoader(
        opts, _Stream(), batch_size=2, mode=poptorch.DataLoaderMode.AsyncRebatched,
        rebatched_worker_size=5), match="rebatched_worker_size")


def test_rebatched_size_in_async_options_is_an_assertion():
    _raises(AssertionError, lambda: poptorch.DataLoader(
        poptorch.Options(), _DATA, batch_size=2,
        mode=poptorch.DataLoaderMode.AsyncRebatched, async_options={"rebatched_size": 4}),
        match="rebatched_size")


def test_unknown_async_options_is_a_type_error():
    _raises(TypeError, lambda: poptorch.DataLoader(
        poptorch.Options(), _DATA, batch_size=2, mode=poptorch.DataLoaderMode.Async,
        async_options={"buffer": 4}), match="Unknown async_options")


def test_accessor_of_something_not_iterable_is_a_type_error():
    _raises(TypeError, lambda: poptorch.AsynchronousDataAccessor(42), match="iterable")


# ------------------------------------------------------------------- poptorch.optim
def _params() -> list[torch.nn.Parameter]:
    return list(torch.nn.Linear(2, 2).parameters())


@pytest.mark.parametrize("make", [
    lambda: poptorch.optim.SGD(_params(), lr=0.1, momentum=0.9, accum_type=torch.int32),
    lambda: poptorch.optim.SGD(_params(), lr=0.1, momentum=0.9,
                               velocity_accum_type=torch.float64),
    lambda: poptorch.optim.Adam(_params(), first_order_momentum_accum_type=torch.float64),
    lambda: poptorch.optim.AdamW(_params(), second_order_momentum_accum_type=torch.int8),
    lambda: poptorch.optim.RMSprop(_params(), accum_type=torch.float64),
    lambda: poptorch.optim.LAMB(_params(), accum_type=torch.int32)])
def test_accumulation_type_other_than_float16_or_float32_is_an_assertion(make):
    _raises(AssertionError, make, match="is not supported")


@pytest.mark.parametrize("mark", ["markAsConstant", "markAsVariable"])
def test_marking_an_unknown_attribute_is_an_assertion(mark):
    opt = poptorch.optim.SGD(_params(), lr=0.1)
    _raises(AssertionError, lambda: getattr(opt.variable_attrs, mark)("learning_rate"),
            match="Unknown optimizer attribute 'learning_rate'")
    getattr(opt.variable_attrs, mark)("lr")  # a known one is fine


@pytest.mark.parametrize("cls", [poptorch.optim.Adam, poptorch.optim.AdamW])
def test_amsgrad_is_a_value_error(cls):
    _raises(ValueError, lambda: cls(_params(), amsgrad=True), match="amsgrad")


def test_loading_a_state_that_is_no_optimizer_state_is_a_runtime_error():
    opt = poptorch.optim.SGD(_params(), lr=0.1)
    _raises(RuntimeError, lambda: opt.load_state_dict({}), match="state_dict")


def test_lamb_hyperparameters_out_of_range_are_value_errors():
    # (upstream takes them unchecked; torch.optim's optimizers raise ValueError)
    _raises(ValueError, lambda: poptorch.optim.LAMB(_params(), betas=(1.5, 0.9)))
    _raises(ValueError, lambda: poptorch.optim.LAMB(_params(), lr=-1.0))


# --------------------------------------------------------------------------- blocks
def test_begin_block_of_something_not_callable_is_an_error():
    _raises(poptorch.Error, lambda: poptorch.BeginBlock(42, ipu_id=1), match="BeginBlock")


def test_remove_blocks_of_something_not_a_module_is_an_assertion():
    _raises(AssertionError, lambda: poptorch.removeBlocks([torch.nn.Linear(2, 2)]),
            match="torch.nn.Module")


def test_recomputation_checkpoint_of_a_non_tensor_is_a_value_error():
    _raises(ValueError, lambda: poptorch.recomputationCheckpoint(torch.ones(2), 3.0),
            match="expects tensors")


@pytest.mark.parametrize("make,expected", [
    (lambda: poptorch.Block("enc", ipu_id="1"), TypeError),
    (lambda: poptorch.Block(["enc"]), TypeError),
    (lambda: poptorch.Block("enc", ipu_id=-1), ValueError),
    (lambda: poptorch.BlockFunction("enc", ipu_id=1.5), TypeError),
    (lambda: poptorch.BeginBlock(torch.nn.Linear(2, 2), ipu_id="0"), TypeError)])
def test_block_ids_are_checked_when_the_block_is_made(make, expected):
    # upstream: the same value fails later, when the model is traced (docs/option-effects.md)
    _raises(expected, make)


# ------------------------------------------------------------------------ options
@pytest.mark.parametrize("setter,args,expected", [
    # values both refuse, with upstream's class (the options audit)
    ("connectionType", ("Always!",), AssertionError),
    ("randomSeed", ("1",), AssertionError),
    ("useIpuId", (0.5,), AssertionError),
    ("Training.accumulationAndReplicationReductionType", (poptorch.ReductionType.NoReduction,),
     ValueError),
    ("Precision.setPartialsType", (torch.int32,), ValueError),
    ("inputReplicaGrouping", (1, poptorch.CommGroupType.All), ValueError),
    # values we refuse where upstream stores them (docs/option-effects.md)
    ("deviceIterations", (0,), AssertionError),
    ("Training.gradientAccumulation", (-1,), AssertionError),
    ("enableStableNorm", ("yes",), AssertionError),
    ("setAvailableMemoryProportion", ({"IPU0": 1.5},), AssertionError),
    ("Distributed.configureProcessId", (2, 2), AssertionError)])
def test_option_refusals_raise_upstreams_class(setter, args, expected):
    target = poptorch.Options()
    *path, name = setter.split(".")
    for part in path:
        target = getattr(target, part)
    _raises(expected, lambda: getattr(target, name)(*args), match=setter.split(".")[-1])


def test_frozen_options_refuse_with_an_attribute_error():
    opts = poptorch.Options()
    poptorch.inferenceModel(torch.nn.Linear(2, 2), opts)
    _raises(AttributeError, lambda: opts.deviceIterations(2))


@pytest.mark.parametrize("setter,args", [
    # accepted here, refused upstream: deliberate (docs/option-effects.md)
    ("Jit.traceModel", (True,)),
    ("connectionType", (1,)),
    ("outputMode", ("All",)),
    ("syncPattern", (0,)),
    ("Training.setMeanAccumulationAndReplicationReductionStrategy", (1,))])
def test_documented_leniencies_are_accepted(setter, args):
    target = poptorch.Options()
    *path, name = setter.split(".")
    for part in path:
        target = getattr(target, part)
    getattr(target, name)(*args)


@pytest.mark.parametrize("strategy", [poptorch.SerialPhasedExecution,
                                      poptorch.ParallelPhasedExecution])
def test_phased_execution_without_phases_is_an_assertion(strategy):
    _raises(AssertionError, lambda: poptorch.Options().setExecutionStrategy(strategy()),
            match="needs its phases")
    phased = strategy(poptorch.Phase("0"), poptorch.Phase("1"))
    assert poptorch.Options().setExecutionStrategy(phased)._execution_strategy is phased
