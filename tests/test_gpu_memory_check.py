"""``benchmarks/gpu_memory_check.py`` (a step of gpu_check.sh) on the CPU: ``--device cpu
--tiny`` runs the GPU path's code with a tiny GPT and prints one row per tensor
location. Its figures (live tensor bytes after the steps) are checked against a plain
PyTorch loop of the same model: weights, gradients and AdamW's two moments; with the
weights, accumulators and optimizer state sharded over 2 processes, each holds its half
of the tensors that are sharded and the whole of the others."""
import os
import re
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "gpu_memory_check.py")
ROWS = ("default options", "weights + accumulators + optimizer RTS",
        "weights + accumulators + optimizer off chip")


def _run(*args: str) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1", POPTORCH_LOG_LEVEL="WARN",
               PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "src"),
                                           os.environ.get("PYTHONPATH", "")]))
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    run = subprocess.run([sys.executable, SCRIPT, "--device", "cpu", "--tiny", *args],
                         check=False, capture_output=True, text=True, timeout=240, env=env)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return run.stdout


def _rows(text: str) -> dict:
    """config -> (MiB, ratio), or None for a skipped row."""
    rows = {}
    for name in (*ROWS, "off chip + RTS"):
        match = re.search(rf"^\| {re.escape(name)} \| ([^|]+) \| ([^|]*) \|$", text, re.M)
        if match:
            cells = match.group(1).strip(), match.group(2).strip()
            rows[name] = None if cells[0].startswith("skipped") else tuple(map(float, cells))
    return rows


def _plain_bytes(processes: int) -> tuple[int, int]:
    """Plain PyTorch: the tiny GPT trained a step with torch.optim.AdamW; the bytes of
    its weights, gradients and state, whole, and per process with the tensors of at
    least the script's threshold sharded over ``processes`` (the root's own stay
    whole)."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import gpu_memory_check as check
        from workloads import GPT
    finally:
        sys.path.pop(0)
    torch.manual_seed(0)
    model = GPT(**check.TINY)
    optimizer = torch.optim.AdamW(model.parameters(), lr=check.LR)
    x = torch.randint(0, check.TINY["vocab"], (check.BATCH, check.TINY["context"]))
    model(x, x)[1].backward()
    optimizer.step()
    own = {id(p) for p in model.parameters(recurse=False)}
    whole = per_process = 0
    for p in model.parameters():
        size = sum(t.numel() * t.element_size() for t in
                   [p, p.grad, *optimizer.state[p].values()] if t.dim() > 0)
        whole += size
        sharded = p.numel() >= 64 and id(p) not in own  # (the script's tiny threshold)
        per_process += -(-size // processes) if sharded else size
    return whole, per_process


def test_one_process_prints_default_and_off_chip_and_skips_rts():
    text = _run()
    assert "RTS needs 2 processes (1 found): its row is skipped." in text, text
    rows = _rows(text)
    assert rows.keys() == set(ROWS), text
    assert rows["weights + accumulators + optimizer RTS"] is None
    whole, _ = _plain_bytes(1)
    assert rows["default options"][0] == pytest.approx(whole / 2**20, abs=0.05), text
    assert rows["default options"][1] == 1.0
    # on the CPU off chip moves nothing
    assert rows["weights + accumulators + optimizer off chip"][1] == pytest.approx(1.0,
                                                                                   abs=0.02)


@pytest.mark.slow
def test_two_processes_under_torchrun_print_every_row():
    text = _run("--procs", "2", "--steps", "1")
    rows = _rows(text)
    assert rows.keys() == set(ROWS) | {"off chip + RTS"}, text
    assert all(row is not None for row in rows.values()), text
    whole, per_process = _plain_bytes(2)
    assert rows["default options"][0] == pytest.approx(whole / 2**20, abs=0.05), text
    for name in ("weights + accumulators + optimizer RTS", "off chip + RTS"):
        assert rows[name][1] == pytest.approx(per_process / whole, abs=0.03), text
