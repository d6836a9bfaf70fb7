"""Faults while loading data: an exception in a worker reaches the caller as the original
type with the worker's traceback, a worker killed by a signal is a poptorch.Error naming
the signal, both within 5 s; and after an exception, a KeyboardInterrupt, terminate(),
garbage collection or the program's end no child process and nothing in /dev/shm is left.

Each mode is checked against torch's own DataLoader where torch has the behaviour (Sync
mode *is* torch's loader; the asynchronous ones add a process in between).
"""
import _thread
import gc
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import psutil
import pytest
import torch
from torch.utils.data import Dataset

import poptorch
from _processes import children, pid_alive, wait_until
from poptorch import DataLoaderMode

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.filterwarnings("ignore:This DataLoader will create")]

DEADLINE_S = 5.0
# (mode, num_workers): Sync with workers is torch's loader (its workers' faults must also
# come out as documented); Async with 0 workers loads in the accessor's own process.
CASES = [(DataLoaderMode.Sync, 2), (DataLoaderMode.Async, 0), (DataLoaderMode.Async, 2),
         (DataLoaderMode.AsyncRebatched, 2)]
IDS = [f"{mode.name}-w{workers}" for mode, workers in CASES]


class CorruptRecord(Exception):
    """A user's own exception type (module level, so that it can be rebuilt)."""


class FailsAt(Dataset):
    def __init__(self, bad_index, error=CorruptRecord):
        self.bad_index = bad_index
        self.error = error

    def __len__(self):
        return 64

    def __getitem__(self, i):
        if i == self.bad_index:
            raise self.error(f"record {i} is corrupt")
        return torch.tensor([i])


class Slow(Dataset):
    def __init__(self, size=10**6, delay=0.01):
        self.size = size
        self.delay = delay

    def __len__(self):
        return self.size

    def __getitem__(self, i):
        time.sleep(self.delay)
        return torch.tensor([i])


def shm_entries(pids):
    """/dev/shm entries named after one of ``pids`` (torch names its segments
    torch_<pid>_...; multiprocessing's are unlinked at creation)."""
    try:
        names = os.listdir("/dev/shm")
    except FileNotFoundError:
        return set()
    return {n for n in names if any(f"_{pid}_" in n for pid in pids)}


def loader_for(dataset, mode, workers, **kwargs):
    return poptorch.DataLoader(poptorch.Options(), dataset, batch_size=2,
                               num_workers=workers, mode=mode, **kwargs)


def assert_nothing_left(before, pids):
    assert wait_until(lambda: children() <= before), children() - before
    assert not shm_entries(pids)


# -- exceptions ----------------------------------------------------------------------
def torch_reference_error(dataset):
    """The exception type torch's own loader raises in the caller (the same with and
    without workers; without, its clean-up does not wait on them)."""
    reference = torch.utils.data.DataLoader(dataset, batch_size=2)
    try:
        list(reference)
    except Exception as error:  # noqa: BLE001 - the reference decides the type
        kind = type(error)
    del reference  # no workers, no cycle: freed here (a full gc pass costs seconds late
    return kind    # in a long test session)


@pytest.mark.parametrize("mode,workers,error", [
    (DataLoaderMode.Sync, 2, CorruptRecord), (DataLoaderMode.Async, 0, CorruptRecord),
    (DataLoaderMode.Async, 0, KeyError), (DataLoaderMode.Async, 2, CorruptRecord),
    (DataLoaderMode.AsyncRebatched, 2, KeyError)], ids=lambda v: getattr(v, "name",
                                                                          str(v)))
def test_worker_exception_keeps_its_type_and_traceback(mode, workers, error):
    expected = torch_reference_error(FailsAt(9, error))
    before = children()
    loader = loader_for(FailsAt(9, error), mode, workers)
    start = time.monotonic()
    with pytest.raises(error) as info:
        for _ in loader:
            pass
    assert time.monotonic() - start < DEADLINE_S
    assert type(info.value) is expected
    message = str(info.value)
    assert "record 9 is corrupt" in message
    assert "Traceback" in message and "in __getitem__" in message
    assert "raise self.error(" in message  # the worker's source line
    pids = children() - before
    loader.terminate()
    assert_nothing_left(before, pids | {os.getpid()})


# -- a worker killed by a signal -----------------------------------------------------
def _victim(mode, before):
    """The process whose death loses a batch: a torch worker, or the accessor's."""
    procs = [psutil.Process(pid) for pid in children() - before]
    if mode == DataLoaderMode.Sync:
        return procs[0].pid
    accessor = [p for p in procs if p.ppid() == os.getpid()]
    torch_workers = [p for p in procs if p.ppid() != os.getpid()]
    return (torch_workers or accessor)[0].pid


@pytest.mark.parametrize("mode,workers", CASES, ids=IDS)
def test_killed_worker_is_a_poptorch_error_naming_the_signal(mode, workers):
    before = children()
    loader = loader_for(Slow(), mode, workers)
    iterator = iter(loader)
    next(iterator)
    victim = _victim(mode, before)
    pids = children() - before
    start = time.monotonic()
    # torch's SIGCHLD handler reports a dead worker at once, wherever the caller is:
    # the kill is inside the block
    with pytest.raises(poptorch.Error, match="killed by signal SIGKILL") as info:
        os.kill(victim, signal.SIGKILL)
        for _ in iterator:
            pass
    assert time.monotonic() - start < DEADLINE_S
    assert str(victim) in str(info.value)
    loader.terminate()
    del iterator, loader
    gc.collect()
    assert_nothing_left(before, pids | {os.getpid()})


def test_torch_worker_death_messages_are_translated():
    """Both of torch's wordings (signal handler, liveness check) become poptorch.Error."""
    from poptorch.data.faults import as_worker_death
    killed = as_worker_death(RuntimeError(
        "DataLoader worker (pid 4242) is killed by signal: Killed. "))
    assert isinstance(killed, poptorch.Error) and "pid 4242" in killed.message
    assert "SIGKILL" in killed.message
    exited = as_worker_death(RuntimeError(
        "DataLoader worker (pid(s) 17, 18) exited unexpectedly"))
    assert isinstance(exited, poptorch.Error) and "17, 18" in exited.message
    assert as_worker_death(RuntimeError("something else")) is None
    assert as_worker_death(ValueError("DataLoader worker (pid 1) is killed")) is None


# -- nothing left behind ---------------------------------------------------------------
@pytest.mark.parametrize("mode,workers,how", [
    (DataLoaderMode.Async, 2, "terminate"), (DataLoaderMode.Async, 2, "gc"),
    (DataLoaderMode.Async, 2, "exception"), (DataLoaderMode.Async, 2, "keyboard_interrupt"),
    (DataLoaderMode.Async, 0, "keyboard_interrupt"), (DataLoaderMode.Sync, 2, "terminate"),
    (DataLoaderMode.Sync, 2, "keyboard_interrupt")], ids=lambda v: getattr(v, "name",
                                                                            str(v)))
def test_no_process_or_shared_memory_left(mode, workers, how, request):
    if how == "keyboard_interrupt":
        request.getfixturevalue("ctrl_c_raises_keyboard_interrupt")
    before = children()
    loader = loader_for(Slow(delay=0.02), mode, workers)
    iterator = iter(loader)
    next(iterator)
    pids = (children() - before) | {os.getpid()}
    assert pids - {os.getpid()}
    if how == "terminate":
        loader.terminate()
    elif how == "exception":
        with pytest.raises(RuntimeError, match="user code failed"):
            for _ in iterator:
                raise RuntimeError("user code failed")
    elif how == "keyboard_interrupt":
        # Ctrl-C while the caller waits for a batch (SIGINT raises it in the main thread)
        timer = threading.Timer(0.2, _thread.interrupt_main)
        timer.start()
        with pytest.raises(KeyboardInterrupt):
            while True:
                next(iterator)
        timer.cancel()
    del iterator, loader
    gc.collect()
    assert_nothing_left(before, pids)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("ending", ["normal"])
def test_program_end_leaves_nothing(tmp_path, ending):
    """A whole program with loaders of each kind: at its normal end every worker is gone
    and /dev/shm holds nothing of theirs (Ctrl-C: test_data_async.py; "sigint" here
    checks the same for these loaders)."""
    script = tmp_path / "program.py"
    script.write_text(textwrap.dedent(f"""
        import os, sys, time, psutil, torch, poptorch
        from torch.utils.data import TensorDataset
        if __name__ == "__main__":
            data = TensorDataset(torch.arange(400))
            Mode = poptorch.DataLoaderMode
            loaders = [poptorch.DataLoader(poptorch.Options(), data, batch_size=4,
                                           num_workers=w, mode=m)
                       for m, w in ((Mode.Sync, 2), (Mode.Async, 0), (Mode.Async, 2))]
            iterators = [iter(loader) for loader in loaders]
            for it in iterators:
                next(it)
            pids = [p.pid for p in psutil.Process().children(recursive=True)]
            print(" ".join(map(str, pids)), flush=True)
            if {ending!r} == "normal":
                for loader in loaders:
                    assert len(list(loader)) == 100
            else:
                while True:
                    for it in iterators:
                        next(it)
                    time.sleep(0.01)
    """))
    process = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        pids = [int(p) for p in process.stdout.readline().split()]
        assert len(pids) >= 5, process.stderr.read()
        if ending == "sigint":
            os.killpg(process.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
        _, stderr = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    if ending == "sigint":
        assert "KeyboardInterrupt" in stderr
    elif ending == "normal":
        assert process.returncode == 0, stderr
    assert wait_until(lambda: not any(pid_alive(p) for p in pids))
    assert not shm_entries(pids + [process.pid])


def test_shared_memory_names_of_a_dead_worker_are_released():
    """A worker killed between creating a batch's shared memory and unlinking its name
    leaves /dev/shm/torch_<pid>_...; stopping the workers removes the names of the dead
    ones, never those of a live process."""
    import multiprocessing
    import types
    from poptorch.data.faults import stop_torch_workers
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm on this system")
    dead = multiprocessing.get_context("fork").Process(target=os._exit, args=(0,))
    dead.start()
    dead.join()
    left = f"/dev/shm/torch_{dead.pid}_0_poptorch_test"
    live = f"/dev/shm/torch_{os.getpid()}_0_poptorch_test"
    for path in (left, live):
        with open(path, "wb") as f:
            f.write(b"x")
    try:
        stop_torch_workers(types.SimpleNamespace(_workers=[dead]))
        assert not os.path.exists(left)
        assert os.path.exists(live)
    finally:
        for path in (left, live):
            if os.path.exists(path):
                os.unlink(path)


def test_terminate_releases_the_shared_memory_names_its_workers_left():
    """Sync mode's terminate() stops torch's workers (killing one that does not stop in
    time): the /dev/shm names such a worker leaves are removed with it."""
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm on this system")
    before = children()
    loader = loader_for(Slow(delay=0.02), DataLoaderMode.Sync, 2)
    iterator = iter(loader)
    next(iterator)
    workers = children() - before
    assert workers
    left = [f"/dev/shm/torch_{pid}_0_poptorch_test" for pid in workers]
    for path in left:
        with open(path, "wb") as f:
            f.write(b"x")
    try:
        loader.terminate()
        assert not [path for path in left if os.path.exists(path)]
    finally:
        for path in left:
            if os.path.exists(path):
                os.unlink(path)
        del iterator, loader
        gc.collect()
