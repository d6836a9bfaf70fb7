"""Which torch device plays each IPU.

* With NVIDIA GPUs (``torch.cuda.is_available()``), IPU *k* is ``cuda:(first + k)``,
  where ``first`` is ``Options.useIpuId`` (default 0). With several processes on one
  machine (torchrun's ``LOCAL_RANK`` / ``LOCAL_WORLD_SIZE``, or mpirun's) each process
  takes an equal, disjoint share of the GPUs and IPU *k* is the *k*-th GPU of its share.
* Without one, or with ``Options.useIpuModel(True)`` / ``POPTORCH_IPU_MODEL=1``, IPUs
  are virtual devices on the CPU: every IPU is ``torch.device("cpu")``.

The machine's *IPU hardware* is what we run on: its GPUs, or the CPU when it has none.
The hardware queries describe that hardware and, as upstream's, ignore
``POPTORCH_IPU_MODEL`` (which picks the target, not the machine): the CPU counts as
hardware, so ``useIpuModel(False)`` on a machine without GPU runs on the CPU.
``useIpuId(n)`` names GPU ``n``: without it, :py:class:`poptorch.Error`.

A model needing more IPUs than there are GPUs from ``first`` on shares them: IPU *k*
runs on the ``k``-th of those GPUs modulo their number (logged at INFO).

``POPTORCH_WAIT_FOR_IPU=1`` waits, polling, until the GPUs are free. A GPU is judged
*busy* when less than half of its memory is free, not counting memory this process's
caching allocator reserved (``torch.cuda.mem_get_info``). GPUs, unlike IPUs, can be
shared, so without the variable a busy GPU is used anyway with a warning.
"""
from __future__ import annotations

import logging
import os
import time

import torch

from . import _logging
from ._typing import OptionsView
from .errors import Error

__all__ = [
    "acquire_devices",
    "env_setting",
    "ipuHardwareIsAvailable",
    "ipuHardwareVersion",
    "ipu_device",
    "round_num_ipus",
    "uses_ipu_model",
]

BUSY_FREE_FRACTION = 0.5
"""A GPU with less than this fraction of its memory free (ours excluded) is busy."""
WAIT_POLL_SECONDS = 1.0
"""How often ``POPTORCH_WAIT_FOR_IPU`` checks again for free GPUs."""
WAIT_LOG_SECONDS = 60.0
"""How often a waiting process says that it is still waiting."""


def env_setting(name: str) -> bool | None:
    """An on/off environment variable: None when unset or empty, False for 0 / false /
    no / off, True otherwise."""
    value = os.environ.get(name, "").strip().lower()
    if not value:
        return None
    return value not in ("0", "false", "no", "off")


def _env_flag(name: str) -> bool:
    return bool(env_setting(name))


def _gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


IPU_HARDWARE_VERSION = 2
"""What :py:func:`ipuHardwareVersion` reports: an Mk2 IPU (the generation PopTorch 3.4
and the libraries built on it, which check for 2 or 21, target)."""


def ipuHardwareIsAvailable(num_ipus: int = 1) -> bool:
    """True if ``num_ipus`` IPUs can run on this machine's hardware: on GPUs, if at
    least ``num_ipus`` are present; on a machine without GPU, always (the CPU plays any
    number of IPUs). ``POPTORCH_IPU_MODEL`` does not change the answer.

    Like upstream, this does not check whether the devices are in use.
    """
    count = _gpu_count()
    return num_ipus <= count if count else True


def ipuHardwareVersion() -> int:
    """The IPU version of this machine's hardware: always 2 (Mk2), whether IPUs run on
    GPUs or on the CPU, so that programs checking for an Mk2 system run. The GPU's own
    CUDA capability is in ``torch.cuda.get_device_capability()``."""
    return IPU_HARDWARE_VERSION


def uses_ipu_model(options: OptionsView | None = None) -> bool:
    """True if IPUs are virtual CPU devices for ``options``.

    Precedence: ``useIpuModel`` if called, then ``POPTORCH_IPU_MODEL``, then "no GPU".
    ``useIpuModel(False)`` on a machine without GPU runs on the CPU, this machine's
    hardware (see the module docstring).
    """
    if options is not None and options.exists("use_model"):
        return bool(options.use_model) or _gpu_count() == 0
    if _env_flag("POPTORCH_IPU_MODEL"):
        return True
    return _gpu_count() == 0


def _model_requested(options: OptionsView | None) -> bool:
    """True if the IPU Model was asked for (``useIpuModel(True)`` or the env var)."""
    if options is not None and options.exists("use_model"):
        return bool(options.use_model)
    return _env_flag("POPTORCH_IPU_MODEL")


# (local rank, processes on this machine) as launchers set them: torchrun, then mpirun
_LOCAL_ENV = (("LOCAL_RANK", "LOCAL_WORLD_SIZE"),
              ("OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"))


def _local_process() -> tuple[int, int]:
    """This process's index among the processes of the run on this machine, and their
    number ((0, 1) outside a multi-process launcher)."""
    for rank_var, size_var in _LOCAL_ENV:
        rank, size = os.environ.get(rank_var), os.environ.get(size_var)
        if rank is not None and size is not None:
            try:
                return int(rank), max(1, int(size))
            except ValueError:
                raise Error(f"{rank_var}={rank!r} / {size_var}={size!r}: expected "
                            "integers (set by the launcher).") from None
    return 0, 1


def _gpu_share() -> tuple[int, int]:
    """(first GPU, number of GPUs) of this process: with several processes on a machine
    (torchrun --nproc_per_node=N) each takes an equal, disjoint share of the GPUs it
    sees, as PopRun gave each instance its own IPUs. When a process sees fewer GPUs than
    there are local processes, the launcher has already given each its own
    (CUDA_VISIBLE_DEVICES): it uses all it sees."""
    count = _gpu_count()
    local_rank, local_size = _local_process()
    if local_size == 1 or count < local_size:
        return 0, count
    per_process = count // local_size
    _logging.info_once(("gpu share", local_rank, local_size, count),
                       "Process %d of %d on this machine uses GPUs cuda:%d to cuda:%d "
                       "(its share of the %d GPUs).", local_rank, local_size,
                       local_rank * per_process, (local_rank + 1) * per_process - 1, count)
    return local_rank * per_process, per_process


def _gpu_range(options: OptionsView | None) -> tuple[int, int]:
    """(first GPU, number of usable GPUs from it) for IPU 0, 1, ...: from
    ``useIpuId`` (a machine-wide GPU index) or this process's share."""
    count = _gpu_count()
    if options is not None and options.exists("ipu_id"):
        ipu_id = options.ipu_id
        if ipu_id >= count:
            raise Error(f"useIpuId({ipu_id}) demands GPU cuda:{ipu_id}, but only {count} "
                        f"NVIDIA GPU(s) are available. Use an id below {count}"
                        f"{'' if count else ' (there is none)'}, or remove the call.")
        return ipu_id, count - ipu_id
    return _gpu_share()


def ipu_device(ipu_id: int, options: OptionsView | None = None) -> torch.device:
    """The torch device that plays IPU ``ipu_id`` under ``options``."""
    if isinstance(ipu_id, bool) or not isinstance(ipu_id, int) or ipu_id < 0:
        raise Error(f"IPU ids are integers >= 0, got {ipu_id!r}.")
    if uses_ipu_model(options):
        explicit_id = options is not None and options.exists("ipu_id")
        if explicit_id and _gpu_count() == 0 and not _model_requested(options):
            _gpu_range(options)  # raises: useIpuId demands a GPU that is not there
        if explicit_id and options is not None:  # (explicit_id: options is not None)
            _logging.info_once(("ipu id ignored", options.ipu_id),
                               "useIpuId(%d) is ignored: the IPU Model (virtual CPU IPUs) "
                               "was requested.", options.ipu_id)
        return torch.device("cpu")
    first, usable = _gpu_range(options)
    return torch.device("cuda", first + ipu_id % usable)


def round_num_ipus(num_ipus: int, auto_round: bool, replicas: int = 1) -> int:
    """Apply PopTorch's power-of-two rule to the IPUs a process reserves: ``num_ipus``
    per replica times ``replicas`` must be a power of two (upstream counts the IPUs of
    all local replicas). Returns the IPUs per replica to use: ``num_ipus`` itself, or
    with ``auto_round`` the next power of two when ``num_ipus`` is not one (the extra
    IPUs are reserved but idle); otherwise a total that is not a power of two is a
    :py:class:`poptorch.Error`."""
    if num_ipus < 1:
        raise Error(f"A model needs at least one IPU, got {num_ipus}.")
    total = num_ipus * replicas

    def power_of_two(n: int) -> bool:
        return n & (n - 1) == 0

    def next_power(n: int) -> int:
        return 1 << (n - 1).bit_length()

    if power_of_two(total):
        return num_ipus
    if not auto_round:
        needs = f"{num_ipus} IPUs" if replicas == 1 else \
            f"{num_ipus} IPU(s) per replica x {replicas} replicas = {total} IPUs"
        raise Error(f"The model needs {needs}, which is not a power of 2: PopTorch "
                    f"reserves a power of 2 of IPUs. Change the annotations (or the "
                    f"replication factor) to use a power of 2, or call "
                    f"opts.autoRoundNumIPUs(True) to reserve {next_power(total)} IPUs.")
    per_replica = num_ipus if power_of_two(num_ipus) else next_power(num_ipus)
    _logging.log_once(logging.WARNING, ("rounded ipus", num_ipus, replicas),
                      "Reserving %d IPUs when the model specifies the use of only %d "
                      "(autoRoundNumIPUs): %d will be reserved but not used.",
                      next_power(total), total, next_power(total) - total)
    return per_replica


def _gpu_is_busy(index: int) -> bool:
    free, total = torch.cuda.mem_get_info(index)
    ours = torch.cuda.memory_reserved(index)
    return (free + ours) < BUSY_FREE_FRACTION * total


def _wait_until_free(indices: list[int]) -> None:
    busy = [i for i in indices if _gpu_is_busy(i)]
    if not busy:
        return
    if not _env_flag("POPTORCH_WAIT_FOR_IPU"):
        _logging.log_once(logging.WARNING, ("busy gpus", tuple(busy)),
                          "GPU(s) %s have less than %d%% of their memory free: another "
                          "process is using them. Running anyway (set "
                          "POPTORCH_WAIT_FOR_IPU=1 to wait until they are free).",
                          ", ".join(f"cuda:{i}" for i in busy),
                          int(BUSY_FREE_FRACTION * 100))
        return
    start = last_log = time.monotonic()
    _logging.logger.info("Waiting for GPU(s) %s to become free (POPTORCH_WAIT_FOR_IPU=1).",
                         ", ".join(f"cuda:{i}" for i in busy))
    while busy:
        time.sleep(WAIT_POLL_SECONDS)
        busy = [i for i in busy if _gpu_is_busy(i)]
        now = time.monotonic()
        if busy and now - last_log >= WAIT_LOG_SECONDS:
            last_log = now
            _logging.logger.info("Still waiting for GPU(s) %s after %.0f s.",
                                 ", ".join(f"cuda:{i}" for i in busy), now - start)


def acquire_devices(options: OptionsView | None, num_ipus: int) -> list[torch.device]:
    """The devices playing IPUs ``0 .. n-1`` for a model needing ``num_ipus`` IPUs.

    ``n`` is ``num_ipus`` after the power-of-two rule, which applies to ``num_ipus``
    times the replication factor (``autoRoundNumIPUs`` rounds up; the extra IPUs are
    reserved but idle). Applies ``useIpuModel`` /
    ``POPTORCH_IPU_MODEL``, ``useIpuId`` and ``POPTORCH_WAIT_FOR_IPU`` and logs the
    devices once at INFO.
    """
    if isinstance(num_ipus, bool) or not isinstance(num_ipus, int):
        raise Error(f"num_ipus must be an integer, got {num_ipus!r}.")
    auto_round = bool(options.auto_round_num_ipus) if options is not None else False
    replicas = int(options.replication_factor) if options is not None else 1
    count = round_num_ipus(num_ipus, auto_round, replicas)
    devices = [ipu_device(k, options) for k in range(count)]
    if devices[0].type == "cuda":
        indices = sorted({d.index for d in devices})
        _wait_until_free(indices)
        if len(indices) < count:
            _logging.info_once(("shared gpus", count, tuple(indices)),
                               "%d IPUs share %d GPU(s): IPU k runs on %s.", count,
                               len(indices), _describe(devices))
    _logging.info_once(("devices", tuple(str(d) for d in devices)),
                       "Running on %s.", _describe(devices))
    return devices


def _describe(devices: list[torch.device]) -> str:
    if all(d.type == "cpu" for d in devices):
        return f"{len(devices)} virtual IPU(s) on the CPU"
    return ", ".join(f"IPU{k}={d}" for k, d in enumerate(devices))
