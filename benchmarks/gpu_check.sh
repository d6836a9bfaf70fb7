#!/usr/bin/env bash
# One command on a fresh GPU machine: install OpenPopTorch, run the test suite on the
# GPUs, run the GPU benchmarks, and write ONE Markdown report.
#
#   benchmarks/gpu_check.sh [REPORT.md]        (default: gpu_check_report.md)
#
# Steps: (1) find the GPUs (nvidia-smi, then torch); without one, the report says so and
# the script exits 0. (2) a virtual environment .venv-gpu: it reuses a CUDA build of
# torch that the machine's python already has (offline machines), else installs one
# (GPU_CHECK_TORCH_INDEX, default the CUDA 12.6 wheels); then `pip install -e .[test]`
# (or, offline, the project alone). (3) the tests with POPTORCH_TEST_DEVICE=cuda (IPU k
# = cuda:k; GPU_CHECK_TESTS="tests/test_x.py ..." narrows them). (4) benchmarks/gpu_bench.py:
# eager loop, torch.compile loop, poptorch default, poptorch with CUDA graphs; GPT-2
# small in bf16 (tokens/s, MFU); torchrun with NCCL on the GPUs present.
# Environment: PYTHON (the interpreter to start from, default python3), GPU_CHECK_SKIP
# (comma list of: install,tests,bench).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
REPORT=${1:-gpu_check_report.md}
case "$REPORT" in /*) ;; *) REPORT="$ROOT/$REPORT" ;; esac
PYTHON=${PYTHON:-python3}
SKIP=",${GPU_CHECK_SKIP:-},"

say() { echo "gpu_check: $*" >&2; }
section() { printf '\n## %s\n\n' "$1" >>"$REPORT"; }
fence() { printf '```\n' >>"$REPORT"; cat "$1" >>"$REPORT"; printf '```\n' >>"$REPORT"; }

{
  echo "# OpenPopTorch GPU check"
  echo
  echo "- date: $(date -u '+%Y-%m-%d %H:%M UTC')"
  echo "- host: $(hostname)"
  echo "- commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
} >"$REPORT"

# ------------------------------------------------------------------ 1. the GPUs
GPUS=""
if command -v nvidia-smi >/dev/null 2>&1; then
  GPUS=$(nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true)
fi
if [ -z "$GPUS" ]; then
  # no nvidia-smi (some containers): ask torch, if the starting python has it
  GPUS=$("$PYTHON" -c 'import torch
if torch.cuda.is_available():
    for i in range(torch.cuda.device_count()):
        print(f"{i}, {torch.cuda.get_device_name(i)}")' 2>/dev/null || true)
fi
if [ -z "$GPUS" ]; then
  section "Result: no GPU found"
  echo "No NVIDIA GPU was found on this machine (no \`nvidia-smi\` listing a GPU, and" >>"$REPORT"
  echo "\`torch.cuda.is_available()\` is not True for \`$PYTHON\`). Nothing was installed," >>"$REPORT"
  echo "tested or measured: run this script on a machine with a GPU." >>"$REPORT"
  say "no GPU found; report: $REPORT"
  exit 0
fi
section "GPUs"
echo "$GPUS" | sed 's/^/- /' >>"$REPORT"
NGPU=$(echo "$GPUS" | grep -c .)
LOG_DIR=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")

# ------------------------------------------------------------------ 2. install
VENV=$ROOT/.venv-gpu
PY=$VENV/bin/python
if [[ $SKIP != *,install,* ]]; then
  say "installing into $VENV"
  if "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    HOW="reused the CUDA build of torch of $PYTHON (--system-site-packages)"
    "$PYTHON" -m venv --system-site-packages "$VENV"
  else
    INDEX=${GPU_CHECK_TORCH_INDEX:-https://download.pytorch.org/whl/cu126}
    HOW="installed torch from $INDEX"
    "$PYTHON" -m venv "$VENV" && "$PY" -m pip install -q torch --index-url "$INDEX" \
      >"$LOG_DIR/torch.log" 2>&1 || { section "Install failed"; fence "$LOG_DIR/torch.log"; exit 1; }
  fi
  if ! "$PY" -m pip install -q -e "$ROOT[test]" >"$LOG_DIR/pip.log" 2>&1; then
    HOW="$HOW; the project without its extras (offline: pip install --no-deps)"
    "$PY" -m pip install -q --no-deps --no-build-isolation -e "$ROOT" >>"$LOG_DIR/pip.log" 2>&1 \
      || { section "Install failed"; fence "$LOG_DIR/pip.log"; exit 1; }
  fi
else
  HOW="skipped (GPU_CHECK_SKIP)"
  [ -x "$PY" ] || PY=$PYTHON
fi
section "Install"
echo "- $HOW" >>"$REPORT"
"$PY" -c 'import torch, poptorch
print(f"- torch {torch.__version__}, CUDA {torch.version.cuda}, cuda available: {torch.cuda.is_available()}, GPUs: {torch.cuda.device_count()}")
print(f"- poptorch {poptorch.__version__} from {poptorch.__file__}")' >>"$REPORT" 2>&1
if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "- torch in $VENV does not see the GPU: stopping here." >>"$REPORT"
  say "torch does not see the GPU; report: $REPORT"
  exit 1
fi

STATUS=0
# ------------------------------------------------------------------ 3. tests
if [[ $SKIP != *,tests,* ]]; then
  say "running the tests on the GPU (POPTORCH_TEST_DEVICE=cuda)"
  # shellcheck disable=SC2086
  POPTORCH_TEST_DEVICE=cuda "$PY" -m pytest -q -rfEs -p no:randomly -p no:cacheprovider \
    ${GPU_CHECK_TESTS:-tests} >"$LOG_DIR/tests.log" 2>&1
  TESTS_RC=$?
  section "Tests (POPTORCH_TEST_DEVICE=cuda): exit $TESTS_RC"
  echo "Summary: \`$(tail -n 1 "$LOG_DIR/tests.log")\`" >>"$REPORT"
  echo >>"$REPORT"
  grep -E '^(FAILED|ERROR) ' "$LOG_DIR/tests.log" | head -n 100 >"$LOG_DIR/failed.txt" || true
  if [ -s "$LOG_DIR/failed.txt" ]; then
    echo "Failures (first 100):" >>"$REPORT"; fence "$LOG_DIR/failed.txt"
  fi
  [ "$TESTS_RC" -eq 0 ] || STATUS=1
fi

# ------------------------------------------------------------------ 4. benchmarks
if [[ $SKIP != *,bench,* ]]; then
  say "running the GPU benchmarks"
  section "Benchmarks"
  PYTHONUNBUFFERED=1 "$PY" "$ROOT/benchmarks/gpu_bench.py" --output "$REPORT" \
    >"$LOG_DIR/bench.log" 2>&1 || { STATUS=1; echo "gpu_bench.py failed:" >>"$REPORT"; tail -n 30 "$LOG_DIR/bench.log" >"$LOG_DIR/bench.tail"; fence "$LOG_DIR/bench.tail"; }
fi

section "Logs"
echo "Full logs: \`$LOG_DIR\` ($NGPU GPU(s))." >>"$REPORT"
say "done (status $STATUS); report: $REPORT"
exit $STATUS
