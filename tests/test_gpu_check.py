"""``benchmarks/gpu_check.sh`` and ``benchmarks/gpu_bench.py`` on a machine without a GPU.

Without a GPU the script stops where it finds none (exit 0, no network, nothing
installed) and its report lists the steps it would have run with their budgets, for both
sizes (``--quick``: at most 5 minutes, the default: at most 9). Its dry run
(``GPU_CHECK_DRY_RUN=1``: the CPU plays the GPU) runs the steps themselves: the offline
install (``pip --no-deps --no-build-isolation --no-index``), the tests, the benchmark
sections, each held to its budget, and what a budget stopped is listed (tests by id,
benchmark rows by name). The benchmark script's code runs end to end on the CPU with
tiny sizes (``--smoke``)."""
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "gpu_check.sh")
LIMITS = {"quick": 300, "default": 540}  # seconds: the sizes' promises
STEPS = ("find the GPUs", "install", "tests on", "benchmark: throughput",
         "benchmark: GPT-2 small", "benchmark: torchrun + NCCL")


def _offline() -> list:
    """A command prefix that runs without any network (a network namespace with no
    interface), where this machine allows one; the check then proves no access."""
    if shutil.which("unshare") and subprocess.run(["unshare", "-n", "true"],
                                                  capture_output=True).returncode == 0:
        return ["unshare", "-n"]
    return []


def _run(tmp_path, *args, timeout=300, **env):
    report = tmp_path / "report.md"
    run = subprocess.run([*_offline(), "bash", SCRIPT, *args, str(report)], check=False,
                         capture_output=True, text=True, timeout=timeout, cwd=tmp_path,
                         env=dict(os.environ, PYTHON=sys.executable, TMPDIR=str(tmp_path),
                                  **env))
    return run, report.read_text() if report.exists() else ""


def _budgets(text: str) -> dict:
    """The budget column of the report's step table(s), by step name."""
    rows = re.findall(r"^\| ([^|]+?) \| (\d+) \|", text, re.M)
    return {name: int(budget) for name, budget in rows}


@pytest.mark.skipif(torch.cuda.is_available() or shutil.which("nvidia-smi") is not None,
                    reason="this machine has a GPU: gpu_check.sh would run in full")
@pytest.mark.parametrize("size", ["quick", "default"])
def test_without_a_gpu_it_reports_the_plan_and_exits_0_offline(tmp_path, size):
    run, text = _run(tmp_path, *(["--quick"] if size == "quick" else []), timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert text.startswith(f"# OpenPopTorch GPU check ({size})")
    assert "## Result: no GPU found" in text and "No NVIDIA GPU was found" in text
    assert "## Tests" not in text and "## Install" not in text  # nothing else was run
    assert not (tmp_path / ".venv-gpu").exists()
    assert "no GPU found" in run.stderr
    budgets = _budgets(text)
    for step in STEPS:  # every step it would have run, with its budget
        assert any(name.startswith(step) for name in budgets), (step, text)
    total = budgets.pop("total (enforced)")
    assert total <= LIMITS[size] - 10 and sum(budgets.values()) <= total, budgets
    if size == "quick":
        tests_row = next(name for name in budgets if name.startswith("tests on"))
        assert "tests/test_cuda_graphs.py" in tests_row and " tests " not in tests_row + " "


def test_dry_run_quick_installs_offline_runs_each_step_and_lists_what_a_budget_stopped(
        tmp_path):
    run, text = _run(tmp_path, "--quick", GPU_CHECK_DRY_RUN="1",
                     GPU_CHECK_TESTS="tests/test_test_device.py",
                     GPU_CHECK_BUDGETS="workloads=2,gpt2=2", OMP_NUM_THREADS="1")
    assert run.returncode == 0, run.stdout + run.stderr + text
    assert "## Install: ok" in text, text
    assert "gave poptorch 3.4.0" in text and "the poprun script: present" in text
    assert re.search(r"## Tests \(POPTORCH_TEST_DEVICE=cpu\): ok\n\nSummary: `\d+ passed",
                     text), text
    steps = text.split("## Steps (quick: ")[1]
    used = int(steps.split(" s of 290 s)")[0])
    assert used <= 290
    assert re.search(r"\| install \| 40 \| \d+ \| ok \|", steps), steps
    assert re.search(r"\| tests on cpu \| 100 \| \d+ \| ok \|", steps), steps
    # the benchmark sections, held to 2 s: each ends in time or is stopped, and then
    # the report lists what it did not measure (here mostly all of it: 2 s is about the
    # time the imports take)
    for step, rows in (("benchmark: throughput", ["tiny infer", "tiny train"]),
                       ("benchmark: GPT-2 small bf16",
                        ["gpt2 eager loop (AdamW)", "gpt2 poptorch default (AdamW)"])):
        row = re.search(rf"\| {re.escape(step)} \| 2 \| (\d+) \| ([^|]+) \|", steps)
        assert row, steps
        assert int(row.group(1)) <= 2 + 15 + 1  # SIGINT at 2 s, SIGKILL 15 s later at most
        if row.group(2).strip() == "ok":
            assert all(f"| {r.split(' ', 1)[-1]} |" in text for r in rows), text
            continue
        assert row.group(2).strip() == "stopped at the budget", steps
        listed = steps.split(f"- {step}: ")[1].splitlines()[0]
        assert listed in ("all of it (stopped before it had listed its rows)",
                          "nothing: every row was measured (stopped while ending)") or \
            all(part in rows for part in listed.split(", ")), listed
    # one GPU: the two-GPU section says so
    assert "| benchmark: torchrun + NCCL | 30 | 0 | skipped: needs 2 GPUs, 1 found |" in text
    assert "Needs 2 GPUs; this machine has 1." in text


def test_dry_run_default_lists_every_test_its_budget_stopped(tmp_path):
    slow = tmp_path / "test_slow.py"  # 8 tests of 3 s: a budget of 10 s stops them
    slow.write_text("import time, pytest\n\n\n@pytest.mark.parametrize('n', range(8))\n"
                    "def test_slow(n):\n    time.sleep(3)\n")
    run, text = _run(tmp_path, GPU_CHECK_DRY_RUN="1", GPU_CHECK_SKIP="install,bench",
                     GPU_CHECK_TESTS=str(slow), GPU_CHECK_BUDGETS="tests=10",
                     OMP_NUM_THREADS="1")
    assert run.returncode == 0, run.stdout + run.stderr + text
    assert text.startswith("# OpenPopTorch GPU check (default)")
    assert "total budget 530 s" in text
    assert "## Tests (POPTORCH_TEST_DEVICE=cpu): stopped at the budget" in text, text
    counts = re.search(r"Stopped at the budget: (\d+) of (\d+) collected tests did not run",
                       text)
    assert counts, text
    not_run, collected = int(counts.group(1)), int(counts.group(2))
    assert collected == 8 and 1 <= not_run <= 8, text
    listed = text.split("did not run (all listed):\n```text\n")[1].split("```")[0].splitlines()
    assert len(listed) == not_run
    assert all(re.fullmatch(r".*test_slow\.py::test_slow\[\d\]", test) for test in listed)
    assert f"- {not_run} tests (listed under Tests)" in text
    assert re.search(r"\| tests on cpu \| 10 \| (\d+) \| stopped at the budget \|", text)


def test_gpu_bench_smoke_runs_every_section_on_the_cpu(tmp_path):
    out = tmp_path / "bench.md"
    progress = tmp_path / "progress.txt"
    env = dict(os.environ, POPTORCH_TORCH_COMPILE_BACKEND="aot_eager", OMP_NUM_THREADS="1",
               POPTORCH_LOG_LEVEL="WARN")
    env.pop("POPTORCH_BACKEND", None)  # poptorch's default, as the GPU run measures it
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(ROOT, "src"),
                                         env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu_bench.py"),
                          "--device", "cpu", "--smoke", "--output", str(out),
                          "--progress", str(progress)],
                         check=False, capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 0, run.stdout + run.stderr
    text = out.read_text()
    assert "failed" not in text, text
    for heading in ("## Throughput on the CPU", "## GPT-2 small, bfloat16 training",
                    "## torchrun, 2 process(es)"):
        assert heading in text, text
    rows = [line for line in text.splitlines() if line.startswith("| tiny |")]
    assert len(rows) == 2  # inference and training
    assert "| 2 | gloo |" in text
    lines = progress.read_text().splitlines()
    planned = {line[5:] for line in lines if line.startswith("plan ")}
    done = {line[5:] for line in lines if line.startswith("done ")}
    assert planned == done == {"tiny infer", "tiny train", "gpt2 eager loop (AdamW)",
                               "gpt2 poptorch default (AdamW)", "ddp 2 processes"}
