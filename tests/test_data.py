"""poptorch.DataLoader: combined batches, structures, shuffling, samplers, distributed
partitions and errors, each checked against a plain torch.utils.data reference.

The asynchronous modes are exercised here too (with the Fork sharing strategy, which
starts quickly); process lifetime and error propagation are in test_data_async.py.
"""
import collections
import inspect
import math

import pytest
import torch
from torch.utils.data import (BatchSampler, Dataset, IterableDataset, SequentialSampler,
                              TensorDataset, get_worker_info)

import poptorch
from poptorch import DataLoaderMode

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.filterwarnings("ignore:This DataLoader will create")]

FORK = {"sharing_strategy": poptorch.SharingStrategy.Fork}
MODES = list(DataLoaderMode)


def make_options(device_iterations=1, replication_factor=1, gradient_accumulation=1,
                 seed=None, process=None):
    opts = poptorch.Options()
    opts.deviceIterations(device_iterations)
    opts.replicationFactor(replication_factor)
    opts.Training.gradientAccumulation(gradient_accumulation)
    if seed is not None:
        opts.randomSeed(seed)
    if process is not None:
        opts.Distributed.configureProcessId(*process)
    return opts


def make_loader(opts, dataset, mode=DataLoaderMode.Sync, **kwargs):
    async_options = FORK if mode != DataLoaderMode.Sync else None
    return poptorch.DataLoader(opts, dataset, mode=mode, async_options=async_options,
                               **kwargs)


def index_dataset(size):
    return TensorDataset(torch.arange(size))


class ShardedRange(IterableDataset):
    """0..size-1, split between the loader's workers as the torch docs recommend."""

    def __init__(self, size):
        self.size = size

    def __len__(self):
        return self.size

    def __iter__(self):
        info = get_worker_info()
        workers, worker = (1, 0) if info is None else (info.num_workers, info.id)
        share = math.ceil(self.size / workers)
        for i in range(worker * share, min(self.size, (worker + 1) * share)):
            yield torch.tensor([i, 10 * i])


Sample = collections.namedtuple("Sample", ["image", "label"])


class Structured(Dataset):
    """Items with nested containers (dict, tuple, list, named tuple) and non-tensors."""

    def __len__(self):
        return 24

    def __getitem__(self, i):
        return {"x": torch.full((2, 3), float(i)),
                "pair": (torch.tensor(i), [torch.tensor([i, -i]), i]),
                "sample": Sample(torch.ones(2) * i, torch.tensor(i % 3)),
                "name": f"item{i}"}


def assert_same_batches(actual, expected):
    assert len(actual) == len(expected)
    for got, want in zip(actual, expected, strict=False):
        assert type(got) is type(want)
        if isinstance(want, torch.Tensor):
            assert torch.equal(got, want)
        elif isinstance(want, dict):
            assert got.keys() == want.keys()
            assert_same_batches(list(got.values()), list(want.values()))
        elif isinstance(want, (list, tuple)):
            assert_same_batches(list(got), list(want))
        else:
            assert got == want


def collect(loader):
    """Batches of an epoch, cloned (asynchronous batches live in a reused ring)."""
    return [torch.utils._pytree.tree_map(
        lambda v: v.clone() if isinstance(v, torch.Tensor) else v, b) for b in loader]


def flat_ids(batches):
    return [i for b in batches for i in (b[0] if isinstance(b, list) else b).tolist()]


# -- combined batch size, len, structure -------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
def test_combined_batches_match_torch_reference(mode):
    d, r, g, b = 2, 2, 3, 2
    opts = make_options(d, r, g)
    data = TensorDataset(torch.randn(100, 3), torch.arange(100))
    loader = make_loader(opts, data, mode, batch_size=b)
    reference = torch.utils.data.DataLoader(data, batch_size=b * d * r * g, drop_last=True)
    assert loader.combinedBatchSize == b * d * r * g
    assert loader.options is opts
    assert isinstance(loader, torch.utils.data.DataLoader)
    assert len(loader) == len(reference) == 100 // 24
    assert_same_batches(collect(loader), list(reference))
    loader.terminate()


@pytest.mark.parametrize("mode", MODES)
def test_nested_structures_and_custom_collate(mode):
    def collate(items):  # a user collate: keeps names, stacks tensors
        out = torch.utils.data.default_collate(items)
        out["count"] = len(items)
        return out

    opts = make_options(device_iterations=2)
    loader = make_loader(opts, Structured(), mode, batch_size=3, collate_fn=collate)
    reference = torch.utils.data.DataLoader(Structured(), batch_size=6, drop_last=True,
                                            collate_fn=collate)
    assert_same_batches(collect(loader), list(reference))
    loader.terminate()


@pytest.mark.parametrize("mode", MODES)
def test_drop_last_false_returns_the_partial_final_batch(mode):
    opts = make_options(device_iterations=2)
    data = index_dataset(10)
    loader = make_loader(opts, data, mode, batch_size=2, drop_last=False)
    reference = torch.utils.data.DataLoader(data, batch_size=4, drop_last=False)
    assert len(loader) == len(reference) == 3
    assert_same_batches(collect(loader), list(reference))
    loader.terminate()


def test_dataset_too_small_names_the_four_factors():
    opts = make_options(3, 2, 2)
    with pytest.raises(poptorch.Error) as info:
        poptorch.DataLoader(opts, index_dataset(20), batch_size=2)
    message = str(info.value)
    for part in ("20 items", "24", "batch_size (2)", "deviceIterations (3)",
                 "replicationFactor (2)", "gradientAccumulation (2)", "drop_last=False"):
        assert part in message
    # drop_last=False accepts it: one incomplete batch, as torch would give
    loader = poptorch.DataLoader(opts, index_dataset(20), batch_size=2, drop_last=False)
    assert [b[0].tolist() for b in loader] == [list(range(20))]


# -- every item once ---------------------------------------------------------------------
@pytest.mark.parametrize("workers", [0, 1, 3])
@pytest.mark.parametrize("mode", MODES)
def test_every_item_seen_exactly_once_per_epoch(mode, workers):
    opts = make_options(device_iterations=2, seed=7)
    if mode == DataLoaderMode.AsyncRebatched:
        # per-worker shares (18, 18, 17) are not multiples of 4: rebatching loses nothing
        data, size = ShardedRange(52), 52
        loader = make_loader(opts, data, mode, batch_size=2, num_workers=workers,
                             rebatched_worker_size=3)
    else:
        data, size = index_dataset(48), 48
        loader = make_loader(opts, data, mode, batch_size=2, num_workers=workers,
                             shuffle=True)
    epochs = [collect(loader) for _ in range(2)]
    for batches in epochs:
        assert all(len(b[0] if isinstance(b, list) else b) == 4 for b in batches)
        ids = flat_ids([b[:, 0] if isinstance(b, torch.Tensor) else b for b in batches])
        assert sorted(ids) == list(range(size))
    if mode != DataLoaderMode.AsyncRebatched:  # shuffled: a new order each epoch
        assert flat_ids(epochs[0]) != flat_ids(epochs[1])
    loader.terminate()


def test_rebatching_uses_all_100_items_with_7_workers():
    """The example of batching.rst: torch (and Sync mode) use 80 items, rebatching 100."""
    data = ShardedRange(100)
    reference = torch.utils.data.DataLoader(data, batch_size=4, num_workers=7,
                                            drop_last=True)
    assert len([i for b in reference for i in b[:, 0].tolist()]) == 80
    loader = make_loader(poptorch.Options(), data, DataLoaderMode.AsyncRebatched,
                         batch_size=4, num_workers=7)
    batches = collect(loader)
    assert [tuple(b.shape) for b in batches] == [(4, 2)] * 25 == [(4, 2)] * len(loader)
    assert sorted(i for b in batches for i in b[:, 0].tolist()) == list(range(100))
    assert all(torch.equal(b[:, 1], 10 * b[:, 0]) for b in batches)  # rows kept intact
    loader.terminate()


def test_rebatched_drop_last_false_keeps_the_tail():
    loader = make_loader(poptorch.Options(), ShardedRange(10),
                         DataLoaderMode.AsyncRebatched, batch_size=4, num_workers=2,
                         drop_last=False, rebatched_worker_size=1)
    batches = collect(loader)
    assert [len(b) for b in batches] == [4, 4, 2] and len(loader) == 3
    assert sorted(i for b in batches for i in b[:, 0].tolist()) == list(range(10))
    loader.terminate()


class Named(IterableDataset):
    def __iter__(self):
        for i in range(8):
            yield {"x": torch.tensor(i), "name": str(i)}


def test_rebatching_needs_tensor_values():
    # the first batch is loaded by the constructor (as upstream's accessor does)
    with pytest.raises(poptorch.Error, match="every value of a batch to be a tensor"):
        make_loader(poptorch.Options(), Named(), DataLoaderMode.AsyncRebatched,
                    batch_size=4, rebatched_worker_size=1)


# -- shuffling ---------------------------------------------------------------------------
def test_shuffle_is_reproducible_from_random_seed():
    data = index_dataset(40)
    orders = []
    for seed in (5, 5, 6):
        loader = poptorch.DataLoader(make_options(seed=seed), data, batch_size=4,
                                     shuffle=True)
        orders.append([flat_ids(collect(loader)) for _ in range(2)])
    reference = torch.utils.data.DataLoader(data, batch_size=4, shuffle=True,
                                            generator=torch.Generator().manual_seed(5))
    assert orders[0] == orders[1] == [flat_ids(list(reference)) for _ in range(2)]
    assert orders[0] != orders[2]
    assert orders[0][0] != orders[0][1]
    async_loader = make_loader(make_options(seed=5), data, DataLoaderMode.Async,
                               batch_size=4, shuffle=True)
    assert [flat_ids(collect(async_loader)) for _ in range(2)] == orders[0]
    async_loader.terminate()


# -- batch_sampler -----------------------------------------------------------------------
def test_batch_sampler_micro_batches_are_joined_into_combined_batches():
    data = index_dataset(23)
    sampler = BatchSampler(SequentialSampler(data), batch_size=3, drop_last=False)
    opts = make_options(device_iterations=2)
    micro = [b[0] for b in torch.utils.data.DataLoader(data, batch_sampler=sampler)]
    expected = [torch.cat(micro[i:i + 2]) for i in range(0, len(micro), 2)]
    kept = poptorch.DataLoader(opts, data, batch_sampler=sampler, drop_last=False)
    assert kept.combinedBatchSize == 6 and kept.batch_sampler_drop_last is False
    assert len(kept) == len(expected) == 4
    assert_same_batches([b[0] for b in kept], expected)
    dropped = poptorch.DataLoader(opts, data, batch_sampler=sampler)
    assert len(dropped) == 3
    assert_same_batches([b[0] for b in dropped], expected[:3])


def test_batch_sampler_with_uneven_micro_batches_is_rejected():
    uneven = [[0, 1], [2, 3, 4], [5, 6], [7, 8]]
    loader = poptorch.DataLoader(make_options(device_iterations=2), index_dataset(9),
                                 batch_sampler=uneven)
    assert loader.combinedBatchSize is None
    with pytest.raises(poptorch.Error, match="same size"):
        list(loader)


def test_batch_sampler_is_exclusive_with_batch_size_and_shuffle():
    sampler = BatchSampler(SequentialSampler(range(8)), 2, False)
    for bad in ({"batch_size": 2}, {"shuffle": True},
                {"sampler": SequentialSampler(range(8))}):
        with pytest.raises(ValueError, match="mutually exclusive"):
            torch.utils.data.DataLoader(index_dataset(8), batch_sampler=sampler, **bad)
        with pytest.raises(ValueError, match="mutually exclusive"):
            poptorch.DataLoader(poptorch.Options(), index_dataset(8),
                                batch_sampler=sampler, **bad)


def test_batch_sampler_accepts_the_defaults_spelled_out_as_torch_does():
    # Lightning re-creates loaders passing batch_size=1, shuffle=False, sampler=None
    data = index_dataset(8)
    sampler = BatchSampler(SequentialSampler(data), 2, False)
    spelled = dict(batch_size=1, shuffle=False, sampler=None)
    expected = [b[0] for b in torch.utils.data.DataLoader(data, batch_sampler=sampler,
                                                          **spelled)]
    loader = poptorch.DataLoader(poptorch.Options(), data, batch_sampler=sampler, **spelled)
    assert_same_batches([b[0] for b in loader], expected)


# -- distributed partitioning ------------------------------------------------------------
@pytest.mark.parametrize("processes", [2, 3])
@pytest.mark.parametrize("shuffle", [False, True])
def test_distributed_shares_are_disjoint_and_complete(processes, shuffle):
    size = processes * 4 * 3  # every share holds 3 whole combined batches of 4
    shares = []
    for rank in range(processes):
        opts = make_options(device_iterations=2, seed=11, process=(rank, processes))
        loader = poptorch.DataLoader(opts, index_dataset(size), batch_size=2,
                                     shuffle=shuffle)
        shares.append(flat_ids(collect(loader)))
        assert len(loader) == 3
    assert sorted(sum(shares, [])) == list(range(size))
    assert all(len(share) == 12 for share in shares)


@pytest.mark.parametrize("processes", [2, 3])
def test_distributed_uneven_sizes_give_equal_batch_counts(processes):
    size = 4 * processes * 2 + 3
    for drop_last in (True, False):
        shares, lengths = [], set()
        for rank in range(processes):
            opts = make_options(device_iterations=2, seed=3, process=(rank, processes))
            loader = poptorch.DataLoader(opts, index_dataset(size), batch_size=2,
                                         shuffle=True, drop_last=drop_last)
            batches = collect(loader)
            lengths.add((len(loader), len(batches)))
            shares.append(flat_ids(batches))
        assert len(lengths) == 1 and len(set(lengths.pop())) == 1
        everything = sum(shares, [])
        if drop_last:  # disjoint; only the remainder is unread
            assert len(set(everything)) == len(everything) == 8 * processes
        else:  # complete; the padding repeats fewer than `processes` items
            assert set(everything) == set(range(size))
            assert len(everything) - size < processes


def test_distributed_shares_in_async_mode_match_sync():
    for rank in (0, 1):
        opts = make_options(device_iterations=2, seed=4, process=(rank, 2))
        sync = poptorch.DataLoader(opts, index_dataset(24), batch_size=2, shuffle=True)
        async_ = make_loader(opts, index_dataset(24), DataLoaderMode.Async, batch_size=2,
                             shuffle=True)
        for _ in range(2):  # the worker's copy of the sampler moves on to a new epoch too
            assert flat_ids(collect(async_)) == flat_ids(collect(sync))
        async_.terminate()


def test_distributed_from_torchrun_environment(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    shares = []
    for rank in (0, 1):
        monkeypatch.setenv("RANK", str(rank))
        loader = poptorch.DataLoader(poptorch.Options(), index_dataset(8), batch_size=2)
        shares.append(flat_ids(collect(loader)))
    assert shares == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_distributed_errors():
    opts = make_options(process=(0, 2))
    # no randomSeed: the processes agree on a seed through the process group, which
    # needs a launcher (tests/test_distributed.py runs the agreement under torchrun)
    with pytest.raises(poptorch.Error, match="MASTER_ADDR and MASTER_PORT"):
        poptorch.DataLoader(opts, index_dataset(8), shuffle=True)
    with pytest.raises(poptorch.Error, match="auto_distributed_partitioning=False"):
        poptorch.DataLoader(opts, ShardedRange(8))
    manual = poptorch.DataLoader(opts, index_dataset(8), batch_size=2,
                                 auto_distributed_partitioning=False)
    assert flat_ids(collect(manual)) == list(range(8))


def test_distributed_batch_sampler_shares():
    shares = []
    for rank in (0, 1):
        sampler = BatchSampler(SequentialSampler(range(16)), 2, False)
        loader = poptorch.DataLoader(make_options(2, process=(rank, 2)), index_dataset(16),
                                     batch_sampler=sampler)
        shares.append(flat_ids(collect(loader)))
        assert len(loader) == 2
    assert sorted(sum(shares, [])) == list(range(16))


# -- argument checks ---------------------------------------------------------------------
def test_bad_arguments_raise_clear_errors():
    data = index_dataset(16)
    with pytest.raises(TypeError, match="poptorch.Options"):
        poptorch.DataLoader(None, data, batch_size=2)
    with pytest.raises(ValueError, match="batch_size"):
        poptorch.DataLoader(poptorch.Options(), data, batch_size=0)
    with pytest.raises(ValueError, match="DataLoaderMode"):
        poptorch.DataLoader(poptorch.Options(), data, mode=7)
    with pytest.raises(ValueError, match="rebatched_worker_size"):
        poptorch.DataLoader(poptorch.Options(), ShardedRange(16), batch_size=2,
                            mode=DataLoaderMode.AsyncRebatched, rebatched_worker_size=3)
    with pytest.raises(TypeError, match="async_options"):
        poptorch.DataLoader(poptorch.Options(), data, mode=DataLoaderMode.Async,
                            async_options={"buffer": 2})


def test_signatures_match_the_reference():
    assert str(inspect.signature(poptorch.DataLoader.__init__)) == (
        "(self, options: 'Options', dataset: 'torch.utils.data.Dataset', "
        "batch_size: 'int | None' = 1, "
        "shuffle: 'bool | None' = None, num_workers: 'int' = 0, drop_last: 'bool' = True, "
        "persistent_workers: 'bool | None' = None, auto_distributed_partitioning: 'bool' "
        "= True, mode: 'DataLoaderMode' = <DataLoaderMode.Sync: 0>, async_options: "
        "'dict[str, OptionValue] | None' = None, rebatched_worker_size: 'int | None' = None, "
        "batch_sampler: 'BatchIndices | None' = None, **kwargs: 'OptionValue') -> 'None'")
    params = inspect.signature(poptorch.AsynchronousDataAccessor.__init__).parameters
    assert [(n, p.default) for n, p in list(params.items())[1:]] == [
        ("dataset", inspect.Parameter.empty), ("buffer_size", 3),
        ("miss_sleep_time_in_ms", 0.1), ("load_indefinitely", True),
        ("early_preload", False), ("sharing_strategy", None),
        ("rebatched_size", None)]
    # Deliberate difference from upstream (default ForkServer, which imports torch again
    # in a fresh interpreter: seconds per loader): None starts the worker as torch's
    # DataLoader starts its workers; an explicit ForkServer still gets a forkserver.
    accessor = poptorch.AsynchronousDataAccessor([torch.zeros(1)])
    assert accessor.sharing_strategy == {
        "fork": poptorch.SharingStrategy.Fork,
        "forkserver": poptorch.SharingStrategy.ForkServer,
        "spawn": poptorch.SharingStrategy.SharedMemory,
    }[torch.multiprocessing.get_start_method()]
    accessor.terminate()


def test_input_replica_grouping_shrinks_the_combined_batch():
    """Replicas of one input group share a micro-batch: the loader's batches must be
    exactly what the executor consumes (checked against the model's own batch rule)."""
    opts = poptorch.Options().replicationFactor(4).deviceIterations(2)
    opts.inputReplicaGrouping(2, poptorch.CommGroupType.Consecutive)
    data = torch.utils.data.TensorDataset(torch.arange(64, dtype=torch.float32).unsqueeze(1))
    loader = poptorch.DataLoader(opts, data, batch_size=3)
    assert loader.combinedBatchSize == 3 * 2 * (4 // 2)
    model = poptorch.inferenceModel(torch.nn.Linear(1, 1), opts)
    (batch,) = next(iter(loader))
    assert model(batch).shape[0] == 2 * 4 * 3  # every replica's output comes back
