"""``benchmarks/gpu_check.sh`` and ``benchmarks/gpu_bench.py`` on a machine without a GPU:
the script stops where it finds none (exit 0, the report says so), and the benchmark
script's code runs end to end on the CPU with tiny sizes (``--smoke``)."""
import os
import shutil
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.skipif(torch.cuda.is_available() or shutil.which("nvidia-smi") is not None,
                    reason="this machine has a GPU: gpu_check.sh would run in full")
def test_gpu_check_without_a_gpu_reports_it_and_exits_0(tmp_path):
    report = tmp_path / "report.md"
    run = subprocess.run(["bash", os.path.join(ROOT, "benchmarks", "gpu_check.sh"),
                          str(report)], check=False, capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PYTHON=sys.executable))
    assert run.returncode == 0, run.stdout + run.stderr
    text = report.read_text()
    assert text.startswith("# OpenPopTorch GPU check")
    assert "## Result: no GPU found" in text and "No NVIDIA GPU was found" in text
    assert "## Tests" not in text and "## Install" not in text  # nothing else was run
    assert not (tmp_path / ".venv-gpu").exists() and not os.path.exists(
        os.path.join(ROOT, ".venv-gpu"))
    assert "no GPU found" in run.stderr


def test_gpu_bench_smoke_runs_every_section_on_the_cpu(tmp_path):
    out = tmp_path / "bench.md"
    env = dict(os.environ, POPTORCH_TORCH_COMPILE_BACKEND="aot_eager", OMP_NUM_THREADS="1",
               POPTORCH_LOG_LEVEL="WARN")
    env.pop("POPTORCH_BACKEND", None)  # poptorch's default, as the GPU run measures it
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(ROOT, "src"),
                                         env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu_bench.py"),
                          "--device", "cpu", "--smoke", "--output", str(out)],
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
