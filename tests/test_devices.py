"""IPU id -> torch device mapping, hardware queries, POPTORCH_IPU_MODEL / WAIT_FOR_IPU.

GPUs are simulated by monkeypatching ``torch.cuda`` queries, so every path runs on a
CPU-only machine; ``test_real_hardware`` checks the real machine as it is.
"""
import logging

import pytest
import torch

import poptorch
from poptorch import _devices, _logging

CPU = torch.device("cpu")


def cuda(k):
    return torch.device("cuda", k)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    monkeypatch.delenv("POPTORCH_IPU_MODEL", raising=False)
    monkeypatch.delenv("POPTORCH_WAIT_FOR_IPU", raising=False)
    for var in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
                "OMPI_COMM_WORLD_LOCAL_SIZE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(_logging, "_once_keys", set())


@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)


class FakeGpus:
    """Simulated GPUs: ``busy_polls[k]`` checks report GPU k busy before it is free."""

    def __init__(self, monkeypatch, count, capability=(9, 0)):
        self.busy_polls = {}
        self.polls = 0
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=0: capability)
        monkeypatch.setattr(torch.cuda, "mem_get_info", self._mem_get_info)
        monkeypatch.setattr(torch.cuda, "memory_reserved", lambda i=0: 0)

    def _mem_get_info(self, index):
        self.polls += 1
        total = 80 * 2**30
        if self.busy_polls.get(index, 0) > 0:
            self.busy_polls[index] -= 1
            return (total // 10, total)
        return (total - 2**30, total)


@pytest.fixture
def gpus(monkeypatch):
    return lambda count, capability=(9, 0): FakeGpus(monkeypatch, count, capability)


# -- without accelerator ------------------------------------------------------------------
def test_no_gpu_means_virtual_cpu_ipus(no_gpu):
    # rule changed (issue 17): the CPU is this machine's IPU hardware, an Mk2 (version 2),
    # so that libraries gating on the hardware queries (Lightning, optimum) run
    assert poptorch.ipuHardwareIsAvailable() and poptorch.ipuHardwareIsAvailable(16)
    assert poptorch.ipuHardwareVersion() == 2
    assert _devices.acquire_devices(poptorch.Options(), 4) == [CPU] * 4
    assert _devices.ipu_device(3) == CPU


def test_hardware_queries_ignore_ipu_model_env(no_gpu, monkeypatch):
    # as upstream: the queries describe the machine; POPTORCH_IPU_MODEL picks the target
    monkeypatch.setenv("POPTORCH_IPU_MODEL", "1")
    assert poptorch.ipuHardwareIsAvailable() and poptorch.ipuHardwareVersion() == 2


def test_use_ipu_model_false_without_gpu_runs_on_the_cpu(no_gpu):
    # rule changed (issue 17): the CPU counts as hardware, so the common
    # useIpuModel(not poptorch.ipuHardwareIsAvailable()) runs here
    assert _devices.acquire_devices(poptorch.Options().useIpuModel(False), 2) == [CPU] * 2


def test_demanding_absent_hardware_is_an_error(no_gpu):
    with pytest.raises(poptorch.Error, match=r"useIpuId\(1\) demands GPU cuda:1.*0 NVIDIA"):
        _devices.acquire_devices(poptorch.Options().useIpuId(1), 1)


def test_ipu_id_ignored_when_ipu_model_requested(no_gpu, monkeypatch):
    monkeypatch.setenv("POPTORCH_IPU_MODEL", "1")
    assert _devices.acquire_devices(poptorch.Options().useIpuId(1), 1) == [CPU]


# -- with (simulated) GPUs ----------------------------------------------------------------
def test_gpus_are_ipus(gpus):
    gpus(4, capability=(8, 6))
    assert poptorch.ipuHardwareIsAvailable(4) and not poptorch.ipuHardwareIsAvailable(5)
    # rule changed (issue 17): GPUs report an Mk2 IPU too, not their CUDA capability
    assert poptorch.ipuHardwareVersion() == 2
    assert _devices.acquire_devices(poptorch.Options(), 2) == [cuda(0), cuda(1)]
    assert _devices.acquire_devices(poptorch.Options().useIpuId(1), 2) == [cuda(1), cuda(2)]
    assert _devices.ipu_device(3, poptorch.Options()) == cuda(3)


@pytest.fixture
def local_processes(monkeypatch):
    """Simulates a launcher's per-machine variables: (local rank, local size)."""
    def set_env(rank, size, names=("LOCAL_RANK", "LOCAL_WORLD_SIZE")):
        for var in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
                    "OMPI_COMM_WORLD_LOCAL_SIZE"):
            monkeypatch.delenv(var, raising=False)
        monkeypatch.setenv(names[0], str(rank))
        monkeypatch.setenv(names[1], str(size))
    return set_env


def test_each_local_process_takes_its_share_of_the_gpus(gpus, local_processes):
    """torchrun --nproc_per_node=2 on a 4-GPU machine: process 0 has cuda:0-1, process 1
    cuda:2-3 (NCCL refuses two processes on one GPU)."""
    gpus(4)
    local_processes(0, 2)
    assert _devices.acquire_devices(poptorch.Options(), 2) == [cuda(0), cuda(1)]
    local_processes(1, 2)
    assert _devices.acquire_devices(poptorch.Options(), 2) == [cuda(2), cuda(3)]
    # more IPUs than the share: they wrap round inside the share, never into another's
    assert _devices.acquire_devices(poptorch.Options(), 4) == [cuda(2), cuda(3)] * 2
    # useIpuId names a GPU of the machine, whatever the share
    assert _devices.acquire_devices(poptorch.Options().useIpuId(0), 1) == [cuda(0)]
    # mpirun's variables count too
    local_processes(3, 4, ("OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"))
    assert _devices.acquire_devices(poptorch.Options(), 1) == [cuda(3)]


def test_a_process_that_sees_fewer_gpus_than_local_processes_uses_what_it_sees(
        gpus, local_processes):
    """The launcher already gave each process its own GPU (CUDA_VISIBLE_DEVICES)."""
    gpus(1)
    local_processes(1, 2)
    assert _devices.acquire_devices(poptorch.Options(), 2) == [cuda(0), cuda(0)]


def test_bad_launcher_variables_are_an_error(gpus, local_processes):
    gpus(2)
    local_processes("x", 2)
    with pytest.raises(poptorch.Error, match="LOCAL_RANK='x'"):
        _devices.acquire_devices(poptorch.Options(), 1)


def test_ipu_model_env_and_option(gpus, monkeypatch):
    gpus(2)
    monkeypatch.setenv("POPTORCH_IPU_MODEL", "1")
    assert _devices.acquire_devices(poptorch.Options(), 2) == [CPU, CPU]
    # useIpuModel takes precedence over the environment variable
    assert _devices.acquire_devices(poptorch.Options().useIpuModel(False), 1) == [cuda(0)]
    monkeypatch.setenv("POPTORCH_IPU_MODEL", "0")
    assert _devices.acquire_devices(poptorch.Options(), 1) == [cuda(0)]
    assert _devices.acquire_devices(poptorch.Options().useIpuModel(True), 1) == [CPU]


def test_more_ipus_than_gpus_share_them(gpus, caplog):
    gpus(2)
    caplog.set_level(logging.INFO, logger="poptorch::python")
    poptorch.setLogLevel("INFO")
    try:
        devices = _devices.acquire_devices(poptorch.Options(), 4)
    finally:
        poptorch.setLogLevel("WARN")
    assert devices == [cuda(0), cuda(1), cuda(0), cuda(1)]
    assert any("4 IPUs share 2 GPU(s)" in r.getMessage() for r in caplog.records)


def test_ipu_id_beyond_gpus_is_an_error(gpus):
    gpus(2)
    with pytest.raises(poptorch.Error, match=r"useIpuId\(2\).*only 2 NVIDIA GPU"):
        _devices.acquire_devices(poptorch.Options().useIpuId(2), 1)


# -- power-of-two rule --------------------------------------------------------------------
@pytest.mark.parametrize("needed,rounded", [(1, 1), (2, 2), (3, 4), (5, 8), (8, 8)])
def test_power_of_two_rule(no_gpu, needed, rounded):
    opts = poptorch.Options()
    if needed != rounded:
        with pytest.raises(poptorch.Error, match=r"not a power of 2.*autoRoundNumIPUs"):
            _devices.acquire_devices(opts, needed)
    opts.autoRoundNumIPUs()
    assert len(_devices.acquire_devices(opts, needed)) == rounded


def test_bad_ipu_arguments(no_gpu):
    with pytest.raises(poptorch.Error, match="at least one IPU"):
        _devices.acquire_devices(poptorch.Options(), 0)
    with pytest.raises(poptorch.Error, match="integer"):
        _devices.acquire_devices(poptorch.Options(), 2.0)
    with pytest.raises(poptorch.Error, match="IPU ids"):
        _devices.ipu_device(-1)


# -- logging and waiting ------------------------------------------------------------------
def test_device_logged_once_at_info(no_gpu, caplog):
    caplog.set_level(logging.INFO, logger="poptorch::python")
    poptorch.setLogLevel("INFO")
    try:
        _devices.acquire_devices(poptorch.Options(), 2)
        _devices.acquire_devices(poptorch.Options(), 2)
    finally:
        poptorch.setLogLevel("WARN")
    running = [r for r in caplog.records if r.getMessage().startswith("Running on")]
    assert len(running) == 1 and running[0].levelno == logging.INFO
    assert "2 virtual IPU(s) on the CPU" in running[0].getMessage()


def test_busy_gpu_without_wait_runs_with_warning(gpus, caplog, monkeypatch):
    fake = gpus(1)
    fake.busy_polls[0] = 100
    monkeypatch.setattr(_devices.time, "sleep", lambda s: pytest.fail("must not wait"))
    caplog.set_level(logging.WARNING, logger="poptorch::python")
    assert _devices.acquire_devices(poptorch.Options(), 1) == [cuda(0)]
    assert any("POPTORCH_WAIT_FOR_IPU" in r.getMessage() and r.levelno == logging.WARNING
               for r in caplog.records)


def test_wait_for_ipu_polls_until_free(gpus, monkeypatch):
    fake = gpus(2)
    fake.busy_polls = {0: 3, 1: 1}
    sleeps = []
    monkeypatch.setattr(_devices.time, "sleep", sleeps.append)
    monkeypatch.setenv("POPTORCH_WAIT_FOR_IPU", "1")
    assert _devices.acquire_devices(poptorch.Options(), 2) == [cuda(0), cuda(1)]
    assert len(sleeps) == 3  # GPU 0 was busy at the first check and two re-checks
    assert all(s == _devices.WAIT_POLL_SECONDS for s in sleeps)


def test_free_gpu_does_not_wait(gpus, monkeypatch):
    gpus(1)
    monkeypatch.setenv("POPTORCH_WAIT_FOR_IPU", "1")
    monkeypatch.setattr(_devices.time, "sleep", lambda s: pytest.fail("must not wait"))
    assert _devices.acquire_devices(poptorch.Options(), 1) == [cuda(0)]


def test_real_hardware():
    """On the machine as it is: GPUs are IPUs if there are any, the CPU otherwise."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    assert poptorch.ipuHardwareIsAvailable()  # the GPUs, or the CPU (issue 17)
    assert poptorch.ipuHardwareVersion() == 2
    device = _devices.acquire_devices(poptorch.Options(), 1)[0]
    assert device == (cuda(0) if count else CPU)
    if count:
        x = torch.arange(4.0)
        assert torch.equal((x.to(device) * 2).cpu(), x * 2)
