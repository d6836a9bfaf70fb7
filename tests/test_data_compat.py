"""Data-loading rules that PopTorch programs rely on (learned from upstream's behaviour),
each checked against a plain torch.utils.data reference: batch samplers whose
``collate_fn`` pads micro-batches, ``batch_size=None``, an accessor over a plain indexable
data set, whole-combined-batch shares per process, a data set that fails on its first
batch, and torch 2.0's ``Sampler(data_source)`` argument.
"""
import pytest
import torch
from torch.utils.data import Dataset, IterableDataset, SequentialSampler

import poptorch
from poptorch import DataLoaderMode

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.filterwarnings("ignore:This DataLoader will create")]

FORK = {"sharing_strategy": poptorch.SharingStrategy.Fork}


class Labelled(Dataset):
    def __init__(self, size):
        self.size = size

    def __len__(self):
        return self.size

    def __getitem__(self, i):
        return torch.full((3, 1), float(i)), torch.tensor([i])


class GrowingBatches(torch.utils.data.Sampler):
    """Micro-batches of 1, 2, ..., batch_size, 1, 2, ... indices (written as for torch
    2.0: the base class gets the unused data_source argument)."""

    def __init__(self, sampler, batch_size):
        super().__init__(None)
        self.sampler = sampler
        self.batch_size = batch_size

    def __iter__(self):
        batch, size = [], 1
        for index in self.sampler:
            batch.append(index)
            if len(batch) == size:
                yield batch
                batch, size = [], size % self.batch_size + 1
        if batch:
            yield batch

    def __len__(self):
        return sum(1 for _ in self)


class Pair:
    """A batch class the model's argument parser knows (registerCustomArgParser)."""

    def __init__(self, data, label):
        self.data = data
        self.label = label


class PairParser(poptorch.ICustomArgParser):
    def yieldTensors(self, struct):
        yield struct.data
        yield struct.label

    def reconstruct(self, original_structure, tensor_iterator):
        return type(original_structure)(*tensor_iterator)


class PadTo:
    """collate_fn padding every micro-batch to ``size`` rows with zeros."""

    def __init__(self, size, as_pair=False):
        self.size = size
        self.as_pair = as_pair

    def __call__(self, items):
        columns = []
        for column in zip(*items, strict=False):
            padding = [torch.zeros_like(column[0])] * (self.size - len(column))
            columns.append(torch.stack(list(column) + padding))
        return Pair(*columns) if self.as_pair else tuple(columns)


@pytest.fixture
def pair_parser():
    poptorch.registerCustomArgParser(Pair, PairParser())
    yield
    poptorch.registerCustomArgParser(Pair, None)


def as_tuple(batch):
    return (batch.data, batch.label) if isinstance(batch, Pair) else tuple(batch)


def torch_micro_batches(dataset, sampler, collate_fn):
    return [as_tuple(b) for b in torch.utils.data.DataLoader(
        dataset, batch_sampler=sampler, collate_fn=collate_fn)]


def joined(micro, group):
    return [tuple(torch.cat(column) for column in zip(*micro[i:i + group], strict=False))
            for i in range(0, len(micro), group)]


# -- batch_sampler + collate_fn --------------------------------------------------------
@pytest.mark.parametrize("mode,workers", [(DataLoaderMode.Sync, 0),
                                          (DataLoaderMode.Sync, 2),
                                          (DataLoaderMode.Async, 0),
                                          (DataLoaderMode.AsyncRebatched, 2)])
@pytest.mark.parametrize("as_pair", [False, True])
def test_padded_micro_batches_are_collated_then_joined(mode, workers, as_pair,
                                                       pair_parser):
    data, size, group = Labelled(47), 4, 3
    collate = PadTo(size, as_pair)
    micro = torch_micro_batches(data, GrowingBatches(SequentialSampler(data), size),
                                collate)
    reference = joined(micro, group)
    assert len(micro) == 20  # 6 combined batches of 3 micro-batches, then 2 more
    for drop_last in (True, False):
        expected = reference if not drop_last or len(micro) % group == 0 \
            else reference[:-1]
        loader = poptorch.DataLoader(
            poptorch.Options().deviceIterations(group), data, collate_fn=collate,
            batch_sampler=GrowingBatches(SequentialSampler(data), size),
            num_workers=workers, drop_last=drop_last, mode=mode,
            async_options=FORK if mode != DataLoaderMode.Sync else None)
        got = [tuple(t.clone() for t in as_tuple(b)) for b in loader]
        assert all(isinstance(b, Pair) == as_pair for b in [loader.__iter__().__next__()])
        assert len(loader) == len(expected)
        assert len(got) == len(expected)
        for g, e in zip(got, expected, strict=False):
            assert all(torch.equal(a, b) for a, b in zip(g, e, strict=False))
        loader.terminate()


@pytest.mark.parametrize("drop_last", [True, False])
def test_incomplete_final_group_follows_drop_last(drop_last):
    data, size, group = Labelled(40), 3, 4
    collate = PadTo(size)
    micro = torch_micro_batches(data, GrowingBatches(SequentialSampler(data), size),
                                collate)
    extra = [[38, 39]]  # one more micro-batch: the final group is incomplete
    sampler = [m for m in GrowingBatches(SequentialSampler(data), size)] + extra
    loader = poptorch.DataLoader(poptorch.Options().deviceIterations(group), data,
                                 batch_sampler=sampler, collate_fn=collate,
                                 drop_last=drop_last)
    micro.append(collate([data[38], data[39]]))
    assert len(micro) % group != 0
    expected = joined(micro, group)
    if drop_last:
        expected = expected[:-1]
    got = [tuple(b) for b in loader]
    assert len(got) == len(loader) == len(expected)
    assert got[-1][0].shape[0] == (group if drop_last else len(micro) % group) * size
    for g, e in zip(got, expected, strict=False):
        assert all(torch.equal(a, b) for a, b in zip(g, e, strict=False))


def test_uneven_micro_batches_after_collate_are_rejected():
    data = Labelled(30)
    loader = poptorch.DataLoader(poptorch.Options().deviceIterations(2), data,
                                 batch_sampler=GrowingBatches(SequentialSampler(data), 3))
    with pytest.raises(poptorch.Error, match="same size"):
        list(loader)


def test_sampler_accepts_torch_2_0_data_source_argument():
    sampler = GrowingBatches(range(7), 3)
    assert list(sampler) == list(GrowingBatches.__iter__(sampler))
    torch.utils.data.Sampler.__init__(sampler, range(7))  # ignored, as torch 2.0 did

    class Cooperative(torch.utils.data.Sampler):
        def __init__(self):
            super().__init__()

        def __iter__(self):
            return iter([0, 1])

    assert list(Cooperative()) == [0, 1]
    with pytest.raises(TypeError):
        torch.utils.data.Sampler.__init__(Cooperative(), None, "unexpected")


# -- batch_size=None -------------------------------------------------------------------
class Items(IterableDataset):
    def __init__(self, size):
        self.size = size

    def __iter__(self):
        return (torch.full((2, 3), float(i)) for i in range(self.size))


class SizedItems(Items):
    def __len__(self):
        return self.size


@pytest.mark.parametrize("mode", [DataLoaderMode.Sync, DataLoaderMode.Async])
def test_batch_size_none_yields_items_unbatched_as_torch(mode):
    for dataset in (Items(6), Labelled(5)):
        reference = list(torch.utils.data.DataLoader(dataset, batch_size=None))
        loader = poptorch.DataLoader(poptorch.Options(), dataset, batch_size=None,
                                     num_workers=1, mode=mode, drop_last=False,
                                     async_options=FORK if mode != DataLoaderMode.Sync
                                     else None)
        assert loader.combinedBatchSize is None
        for _ in range(2):  # two epochs
            got = [torch.utils._pytree.tree_map(torch.clone, b) for b in loader]
            assert len(got) == len(reference)
            for g, e in zip(got, reference, strict=False):
                assert all(torch.equal(a, b) for a, b in zip(
                    torch.utils._pytree.tree_leaves(g), torch.utils._pytree.tree_leaves(e), strict=False))
        if isinstance(dataset, IterableDataset):
            with pytest.raises(TypeError, match="'Items' has no len()"):
                len(loader)
        loader.terminate()
    sized = poptorch.DataLoader(poptorch.Options(), SizedItems(4), batch_size=None,
                                mode=DataLoaderMode.Async, async_options=FORK)
    assert len(sized) == len(torch.utils.data.DataLoader(SizedItems(4), batch_size=None))
    sized.terminate()


# -- the accessor over a plain indexable data set ------------------------------------------
class Indexable(Dataset):
    """Iterable only through __getitem__ (StopIteration past the end)."""

    def __len__(self):
        return 9

    def __getitem__(self, i):
        if i >= 9:
            raise StopIteration
        return torch.full((2,), float(i))


def test_accessor_reads_an_indexable_dataset_item_by_item():
    reference = list(Indexable())  # Python's sequence iteration
    accessor = poptorch.AsynchronousDataAccessor(Indexable(), **FORK)
    assert len(accessor) == len(reference) == 9
    for _ in range(2):
        got = [t.clone() for t in accessor]
        assert len(got) == 9 and all(torch.equal(g, e) for g, e in zip(got, reference, strict=False))
    accessor.terminate()
    with pytest.raises(TypeError, match="iterable data set"):
        poptorch.AsynchronousDataAccessor(42)


# -- distributed shares --------------------------------------------------------------------
@pytest.mark.parametrize("processes,batch,workers", [(3, 4, 0), (2, 2, 3)])
def test_each_process_reads_whole_combined_batches_contiguously(processes, batch,
                                                               workers):
    size = 100
    share = batch * (size // (batch * processes))  # whole combined batches per process
    data = torch.utils.data.TensorDataset(torch.arange(size))
    for rank in range(processes):
        opts = poptorch.Options()
        opts.Distributed.configureProcessId(rank, processes)
        loader = poptorch.DataLoader(opts, data, batch_size=batch, num_workers=workers)
        reference = torch.utils.data.DataLoader(
            torch.utils.data.Subset(data, range(rank * share, (rank + 1) * share)),
            batch_size=batch, drop_last=True)
        assert len(loader) == len(reference) == share // batch
        assert [b[0].tolist() for b in loader] == [b[0].tolist() for b in reference]


# -- a data set that cannot produce its first batch ------------------------------------
class Broken(Dataset):
    def __len__(self):
        return 10

    def __getitem__(self, i):
        raise ValueError("record 0 is corrupt")


@pytest.mark.parametrize("workers", [0, 2])
def test_broken_dataset_fails_in_the_accessor_constructor(workers, capfd):
    with pytest.raises(ValueError, match="corrupt"):  # what torch's loader raises
        next(iter(torch.utils.data.DataLoader(Broken(), num_workers=workers)))
    loader = poptorch.DataLoader(poptorch.Options(), Broken(), num_workers=workers)
    with pytest.raises(poptorch.Error, match="failed to start") as info:
        poptorch.AsynchronousDataAccessor(loader, **FORK)
    assert isinstance(info.value, ValueError)  # still the original type
    assert "record 0 is corrupt" in str(info.value)
    assert "ValueError: record 0 is corrupt" in capfd.readouterr().err  # worker traceback
