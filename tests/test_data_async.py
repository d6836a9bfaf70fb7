"""AsynchronousDataAccessor: sharing strategies, ring-buffer semantics, preloading,
error propagation and process lifetime (no child process or temporary file survives)."""
import gc
import glob
import logging
import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

import psutil
import pytest
import torch
from torch.utils.data import Dataset, TensorDataset

import poptorch
from _processes import children, wait_until
from poptorch import DataLoaderMode, SharingStrategy

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.filterwarnings("ignore:This DataLoader will create")]

FORK = {"sharing_strategy": SharingStrategy.Fork}


class FailsAt(Dataset):
    """Raises inside __getitem__ for one index."""

    def __init__(self, bad_index):
        self.bad_index = bad_index

    def __len__(self):
        return 32

    def __getitem__(self, i):
        if i == self.bad_index:
            raise ValueError(f"corrupt record {i}")
        return torch.tensor([i])


class Counting(Dataset):
    """Counts __getitem__ calls in shared memory (visible from forked workers)."""

    def __init__(self, size):
        self.size = size
        self.calls = multiprocessing.get_context("fork").Value("i", 0)

    def __len__(self):
        return self.size

    def __getitem__(self, i):
        with self.calls.get_lock():
            self.calls.value += 1
        return (torch.tensor(i),)


def index_loader(size=16, batch_size=2, mode=DataLoaderMode.Async, **async_options):
    return poptorch.DataLoader(poptorch.Options(), TensorDataset(torch.arange(size)),
                               batch_size=batch_size, mode=mode,
                               async_options={**FORK, **async_options})


def ids(loader):
    return [i for batch in loader for i in batch[0].tolist()]


# -- sharing strategies ------------------------------------------------------------------
@pytest.mark.parametrize("strategy", list(SharingStrategy))
def test_every_sharing_strategy_gives_the_reference_batches(strategy):
    data = TensorDataset(torch.randn(24, 3), torch.arange(24))
    ours = os.path.join(tempfile.gettempdir(), f"poptorch_dataset_{os.getpid()}_*")
    leftovers = set(glob.glob(ours))
    loader = poptorch.DataLoader(poptorch.Options(), data, batch_size=4,
                                 mode=DataLoaderMode.Async,
                                 async_options={"sharing_strategy": strategy})
    reference = torch.utils.data.DataLoader(data, batch_size=4, drop_last=True)
    for got, want in zip(loader, reference, strict=True):
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    loader.terminate()
    now = set(glob.glob(ours))
    assert now <= leftovers  # the FileSystem strategy's file is gone


# -- the accessor on its own -------------------------------------------------------------
class ChangingBatches(torch.utils.data.IterableDataset):
    """Batches whose structure, shapes and dtypes change from one to the next (the
    accessor sends a changed skeleton, or new shared tensors, only when needed)."""

    def __iter__(self):
        for i in range(14):
            t = torch.full((2, 1 + i % 3), float(i))
            kind = i % 7
            if kind == 0:
                yield (t, torch.tensor([i, i]))
            elif kind == 1:
                yield (t, torch.tensor([i, i]))  # the same skeleton again
            elif kind == 2:
                yield {"a": t, "b": t.long()}
            elif kind == 3:
                yield [t, t, t]
            elif kind == 4:
                yield t
            elif kind == 5:
                yield (t, f"name{i}")  # a non-tensor value: never the short message
            else:
                yield {"b": t, "a": t}  # same keys, other order


def test_batches_of_changing_structure_arrive_intact():
    reference = list(ChangingBatches())
    accessor = poptorch.AsynchronousDataAccessor(ChangingBatches(), buffer_size=2, **FORK)
    for _ in range(2):
        got = [torch.utils._pytree.tree_map(
            lambda v: v.clone() if isinstance(v, torch.Tensor) else v, b) for b in accessor]
        assert len(got) == len(reference)
        for g, e in zip(got, reference, strict=False):
            assert type(g) is type(e)
            if isinstance(e, dict):
                assert list(g) == list(e)
            leaves_g = torch.utils._pytree.tree_leaves(g)
            leaves_e = torch.utils._pytree.tree_leaves(e)
            assert len(leaves_g) == len(leaves_e)
            for x, y in zip(leaves_g, leaves_e, strict=False):
                if isinstance(y, torch.Tensor):
                    assert x.dtype == y.dtype and torch.equal(x, y)
                else:
                    assert x == y
    accessor.terminate()


def test_accessor_wraps_any_torch_dataloader():
    data = TensorDataset(torch.randn(20, 2))
    reference = torch.utils.data.DataLoader(data, batch_size=3, drop_last=False)
    accessor = poptorch.AsynchronousDataAccessor(reference, **FORK)
    assert len(accessor) == len(reference) == 7
    for _ in range(2):  # two epochs
        got = [b[0].clone() for b in accessor]
        assert len(got) == 7
        assert all(torch.equal(g, w[0]) for g, w in zip(got, reference, strict=False))
    accessor.terminate()
    with pytest.raises(poptorch.Error, match="terminated"):
        iter(accessor)


@pytest.mark.parametrize("drop_last", [True, False])
def test_accessor_rebatched_size(drop_last):
    data = TensorDataset(torch.arange(10))
    source = poptorch.DataLoader(poptorch.Options(), data, batch_size=1,
                                 drop_last=drop_last)
    accessor = poptorch.AsynchronousDataAccessor(source, rebatched_size=4, **FORK)
    assert accessor.rebatched_size == 4
    reference = torch.utils.data.DataLoader(data, batch_size=4, drop_last=drop_last)
    got = [b[0].clone() for b in accessor]
    assert len(accessor) == len(reference) == len(got)
    assert all(torch.equal(g, w[0]) for g, w in zip(got, reference, strict=False))
    accessor.terminate()


def test_miss_sleep_time_is_recorded_and_logged_as_without_effect(caplog):
    caplog.set_level(logging.INFO, logger="poptorch::python")
    accessor = poptorch.AsynchronousDataAccessor([torch.zeros(2)], miss_sleep_time_in_ms=5,
                                                 **FORK)
    assert accessor.miss_sleep_time_in_ms == 5
    assert "miss_sleep_time_in_ms=5" in caplog.text and "no effect" in caplog.text
    assert [t.tolist() for t in accessor] == [[0.0, 0.0]]
    accessor.terminate()


def test_accessor_rejects_bad_arguments():
    with pytest.raises(TypeError, match="iterable"):
        poptorch.AsynchronousDataAccessor(42)
    with pytest.raises(ValueError, match="buffer_size"):
        poptorch.AsynchronousDataAccessor([1], buffer_size=0)
    with pytest.raises(ValueError, match="sharing_strategy"):
        poptorch.AsynchronousDataAccessor([1], sharing_strategy="threads")


# -- ring buffer and epochs --------------------------------------------------------------
def test_batches_live_in_shared_memory_and_are_reused():
    """As documented: a batch is valid until the next one is requested (clone to keep)."""
    loader = index_loader(size=8, batch_size=2, buffer_size=1)
    iterator = iter(loader)
    first = next(iterator)[0]
    assert first.is_shared() and first.tolist() == [0, 1]
    second = next(iterator)[0]
    assert second.tolist() == [2, 3]
    assert first.data_ptr() == second.data_ptr() and first.tolist() == [2, 3]
    loader.terminate()


def test_abandoned_epoch_restarts_from_the_beginning():
    loader = index_loader(size=16, batch_size=2, buffer_size=2)
    for _batch, _ in zip(loader, range(3), strict=False):
        pass
    assert ids(loader) == list(range(16))
    assert ids(loader) == list(range(16))
    loader.terminate()


def test_early_preload_and_load_indefinitely():
    lazy = Counting(8)
    loader = poptorch.DataLoader(poptorch.Options(), lazy, batch_size=2,
                                 mode=DataLoaderMode.Async,
                                 async_options={**FORK, "load_indefinitely": False})
    time.sleep(0.5)
    # only the first batch is read before the first iteration (by the constructor, as
    # upstream's accessor does, so that a broken data set fails there)
    assert lazy.calls.value == 2
    assert ids(loader) == list(range(8))
    time.sleep(0.5)
    assert lazy.calls.value == 8  # not loading indefinitely: waits for the next epoch
    assert ids(loader) == list(range(8))
    loader.terminate()

    eager = Counting(8)
    loader = poptorch.DataLoader(poptorch.Options(), eager, batch_size=2,
                                 mode=DataLoaderMode.Async,
                                 async_options={**FORK, "early_preload": True,
                                                "buffer_size": 2})
    assert wait_until(lambda: eager.calls.value >= 4)  # fills the ring before iteration
    assert ids(loader) == list(range(8))
    assert wait_until(lambda: eager.calls.value >= 12)  # preloads the next epoch
    assert ids(loader) == list(range(8))
    loader.terminate()


# -- errors ------------------------------------------------------------------------------
@pytest.mark.parametrize("workers", [0, 2])
def test_dataset_exception_reaches_the_caller_with_its_traceback(workers):
    before = children()
    loader = poptorch.DataLoader(poptorch.Options(), FailsAt(9), batch_size=4,
                                 num_workers=workers, mode=DataLoaderMode.Async,
                                 async_options=FORK)
    start = time.monotonic()
    with pytest.raises(ValueError) as info:
        list(loader)
    assert time.monotonic() - start < 10
    message = str(info.value)
    assert "corrupt record 9" in message
    assert "AsynchronousDataAccessor worker process (pid" in message
    assert "in __getitem__" in message and "Traceback" in message
    if workers:
        assert "DataLoader worker process" in message
    # the loader recovers: the next epoch fails again at the same place, not a hang
    with pytest.raises(ValueError, match="corrupt record 9"):
        list(loader)
    loader.terminate()
    assert wait_until(lambda: children() <= before)


def test_killed_worker_is_reported_not_waited_for():
    before = children()
    loader = poptorch.DataLoader(poptorch.Options(), Counting(10**6), batch_size=2,
                                 mode=DataLoaderMode.Async, async_options=FORK)
    iterator = iter(loader)
    next(iterator)
    (worker,) = children() - before
    os.kill(worker, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(poptorch.Error, match=r"killed by signal SIGKILL"):
        for _ in iterator:
            pass
    assert time.monotonic() - start < 10
    assert wait_until(lambda: children() <= before)


# -- process lifetime --------------------------------------------------------------------
def test_terminate_leaves_no_child_process():
    before = children()
    loader = index_loader(size=64, batch_size=2)
    loader_with_workers = poptorch.DataLoader(
        poptorch.Options(), TensorDataset(torch.arange(64)), batch_size=2, num_workers=2,
        mode=DataLoaderMode.Async, async_options=FORK)
    next(iter(loader))
    next(iter(loader_with_workers))
    assert len(children() - before) >= 4  # two accessors, two data set workers
    loader.terminate()
    loader_with_workers.terminate()
    loader.terminate()  # idempotent
    assert wait_until(lambda: children() <= before)


def test_garbage_collection_stops_the_worker():
    before = children()
    loader = index_loader(size=64, batch_size=2)
    iterator = iter(loader)
    next(iterator)
    assert children() - before
    del loader, iterator
    gc.collect()
    assert wait_until(lambda: children() <= before)


@pytest.mark.timeout(90)
@pytest.mark.usefixtures("ctrl_c_raises_keyboard_interrupt")
def test_ctrl_c_and_interpreter_exit_leave_no_process(tmp_path):
    script = tmp_path / "interrupted.py"
    script.write_text(textwrap.dedent("""
        import psutil, torch, poptorch
        from torch.utils.data import TensorDataset
        if __name__ == "__main__":
            loader = poptorch.DataLoader(
                poptorch.Options(), TensorDataset(torch.arange(10**7)), batch_size=2,
                num_workers=1, mode=poptorch.DataLoaderMode.Async,
                async_options={"sharing_strategy": poptorch.SharingStrategy.Fork})
            iterator = iter(loader)
            next(iterator)
            pids = [p.pid for p in psutil.Process().children(recursive=True)]
            print(" ".join(map(str, pids)), flush=True)
            while True:
                next(iterator)
    """))
    process = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        pids = [int(p) for p in process.stdout.readline().split()]
        assert len(pids) >= 2  # the accessor and its data set worker
        os.killpg(process.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
        _, stderr = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert "KeyboardInterrupt" in stderr
    assert wait_until(lambda: not any(psutil.pid_exists(p) for p in pids))
