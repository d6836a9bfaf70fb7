#!/usr/bin/env bash
# One command on a GPU machine: check the offline install of OpenPopTorch, run the tests
# on the GPU, run the GPU benchmarks, and write ONE Markdown report; sized for a short
# slot of GPU time, with no network.
#
#   benchmarks/gpu_check.sh --quick [REPORT.md]   # at most 5 minutes (one H100)
#   benchmarks/gpu_check.sh [REPORT.md]           # at most 9 minutes
#
# Every step has a wall-clock budget that it is held to (`timeout`), and the whole run a
# total one; the report's "Steps" table gives each step's budget, the time it used and
# how it ended, and lists what did not run (tests by id, benchmark rows by name) when a
# step was stopped at its budget or no time was left for it: nothing is cut silently.
#
# Steps: (1) find the GPUs (nvidia-smi, then torch); without one, the report says so,
# lists the steps it would have run with their budgets, and the script exits 0 having
# installed nothing and reached no network. (2) install: `pip install --no-deps
# --no-build-isolation --no-index` of this checkout into a scratch folder (what a user
# of an offline image does; torch and the rest are the machine's own); the steps below
# run this checkout from PYTHONPATH either way. (3) the tests with
# POPTORCH_TEST_DEVICE=cuda (IPU k = cuda:k): --quick the GPU-relevant files, the default
# those first and then the rest of the suite, until the budget. (4)
# benchmarks/gpu_bench.py, one section per step: throughput (eager loop, torch.compile
# loop, poptorch default, poptorch CUDA graphs), GPT-2 small in bf16 (tokens/s, MFU),
# torchrun with NCCL (needs 2 GPUs: with one, it says so and is skipped). (5)
# benchmarks/gpu_memory_check.py: peak CUDA memory per GPU (max_memory_allocated) of
# GPT-2 small trained a few AdamW steps with default options, weights + accumulators +
# optimizer state replicated-tensor-sharded (under torchrun, one process per GPU: needs
# 2 GPUs, with one that row says so and is skipped) and off chip; one row each, with the
# ratio to default.
#
# Environment: PYTHON (the interpreter, default python3: the machine's own, with torch,
# pytest, hypothesis, psutil), GPU_CHECK_SKIP (comma list of: install,tests,bench),
# GPU_CHECK_TESTS (test files instead of the size's own list), GPU_CHECK_BUDGETS (other
# budgets, e.g. "tests=60,gpt2=30"; names: total gpus install tests workloads gpt2 ddp
# memory),
# GPU_CHECK_DRY_RUN=1 (no GPU needed: every step runs on the CPU as if it were one GPU,
# the benchmarks at their smoke sizes: a check of this script, tests/test_gpu_check.py).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
SIZE=default
REPORT=""
for arg in "$@"; do
  case "$arg" in
    --quick) SIZE=quick ;;
    -h|--help) sed -n '2,30p' "$0"; exit 0 ;;
    -*) echo "gpu_check: unknown option $arg (use --quick or nothing)" >&2; exit 2 ;;
    *) REPORT=$arg ;;
  esac
done
REPORT=${REPORT:-gpu_check_report.md}
case "$REPORT" in /*) ;; *) REPORT="$ROOT/$REPORT" ;; esac
PYTHON=${PYTHON:-python3}
SKIP=",${GPU_CHECK_SKIP:-},"

# The GPU-relevant tests: devices, CUDA graphs, precision, the executor's equivalence
# with plain PyTorch, the compiled step, the tests that skip without a GPU.
GPU_TESTS="tests/test_test_device.py tests/test_devices.py tests/test_cuda_graphs.py
  tests/test_precision.py tests/test_half_float.py tests/test_autocasting.py tests/test_ops.py
  tests/test_compiled_step.py tests/test_executor.py"
# Budgets (seconds). quick: 5 minutes in all, default: 9, each with some margin; the
# steps' budgets add up to at most the total.
if [ "$SIZE" = quick ]; then
  TOTAL=290; B_GPUS=15; B_INSTALL=40; B_TESTS=100; B_WORKLOADS=40; B_GPT2=35; B_DDP=30
  B_MEMORY=30
  TESTS=${GPU_CHECK_TESTS:-$GPU_TESTS}
else
  TOTAL=530; B_GPUS=15; B_INSTALL=40; B_TESTS=230; B_WORKLOADS=90; B_GPT2=60; B_DDP=45
  B_MEMORY=50
  TESTS=${GPU_CHECK_TESTS:-"$GPU_TESTS tests"}
fi
BUDGETS=${GPU_CHECK_BUDGETS:-}
for setting in ${BUDGETS//,/ }; do
  case "${setting%%=*}" in
    total) TOTAL=${setting#*=} ;; gpus) B_GPUS=${setting#*=} ;;
    install) B_INSTALL=${setting#*=} ;; tests) B_TESTS=${setting#*=} ;;
    workloads) B_WORKLOADS=${setting#*=} ;; gpt2) B_GPT2=${setting#*=} ;;
    ddp) B_DDP=${setting#*=} ;; memory) B_MEMORY=${setting#*=} ;;
    *) echo "gpu_check: GPU_CHECK_BUDGETS: unknown step ${setting%%=*}" >&2; exit 2 ;;
  esac
done
DRY_RUN=${GPU_CHECK_DRY_RUN:-0}
TEST_DEVICE=cuda; BENCH_ARGS=(--size "$SIZE"); MEMORY_ARGS=()
[ "$DRY_RUN" = 1 ] && { TEST_DEVICE=cpu; BENCH_ARGS=(--device cpu --size smoke)
                        MEMORY_ARGS=(--device cpu --tiny); }
START=$(date +%s)
DEADLINE=$((START + TOTAL))
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")
export PYTHONPATH="$ROOT/src:$ROOT/benchmarks${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

say() { echo "gpu_check: $*" >&2; }
section() { printf '\n## %s\n\n' "$1" >>"$REPORT"; }
fence() { printf '```text\n' >>"$REPORT"; cat "$1" >>"$REPORT"; printf '```\n' >>"$REPORT"; }
STEPS=()     # rows of the Steps table
NOT_RUN=()   # what did not run, one line each

# run_step NAME BUDGET LOG COMMAND...: COMMAND under the step's budget (and what is left
# of the total one); sets STEP_RESULT (ok / failed (exit N) / stopped at the budget /
# not run) and returns the command's status.
run_step() {
  local name=$1 budget=$2 log=$3 left rc used
  shift 3
  left=$((DEADLINE - $(date +%s)))
  if [ "$left" -lt 5 ]; then
    STEP_RESULT="not run: no time left of the ${TOTAL} s total"
    STEPS+=("| $name | $budget | 0 | $STEP_RESULT |")
    NOT_RUN+=("$name (no time left)")
    return 124
  fi
  [ "$budget" -gt "$left" ] && budget=$left
  local t0
  t0=$(date +%s)
  say "$name (budget ${budget} s)"
  # SIGINT first (pytest and the benchmarks end cleanly), SIGKILL 15 s later
  timeout --signal=INT --kill-after=15 "$budget" "$@" >"$log" 2>&1
  rc=$?
  used=$(( $(date +%s) - t0 ))
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then  # (timeout's status when it stopped it)
    STEP_RESULT="stopped at the budget"
    rc=124
  elif [ "$rc" -eq 0 ]; then
    STEP_RESULT="ok"
  else
    STEP_RESULT="failed (exit $rc)"
  fi
  STEPS+=("| $name | $budget | $used | $STEP_RESULT |")
  return "$rc"
}

plan_table() {
  echo "| step | budget (s) |"
  echo "| --- | --- |"
  echo "| find the GPUs | $B_GPUS |"
  echo "| install (offline: pip --no-deps --no-build-isolation --no-index) | $B_INSTALL |"
  echo "| tests on cuda: $(echo $TESTS | tr '\n' ' ') | $B_TESTS |"
  echo "| benchmark: throughput (eager, torch.compile, poptorch, CUDA graphs) | $B_WORKLOADS |"
  echo "| benchmark: GPT-2 small, bf16 (tokens/s, MFU) | $B_GPT2 |"
  echo "| benchmark: torchrun + NCCL (needs 2 GPUs; skipped with one) | $B_DDP |"
  echo "| benchmark: peak GPU memory, GPT-2 small: default / RTS (needs 2 GPUs) / off chip | $B_MEMORY |"
  echo "| total (enforced) | $TOTAL |"
}

{
  echo "# OpenPopTorch GPU check ($SIZE)"
  echo
  echo "- date: $(date -u '+%Y-%m-%d %H:%M UTC')"
  echo "- host: $(hostname)"
  echo "- commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
  echo "- size: $SIZE, total budget ${TOTAL} s"
} >"$REPORT"

# ------------------------------------------------------------------ 1. the GPUs
GPUS=""
if [ "$DRY_RUN" = 1 ]; then
  GPUS="0, the CPU (GPU_CHECK_DRY_RUN: a check of this script, not of a GPU)"
elif command -v nvidia-smi >/dev/null 2>&1; then
  GPUS=$(timeout "$B_GPUS" nvidia-smi --query-gpu=index,name,memory.total,driver_version \
         --format=csv,noheader 2>/dev/null || true)
fi
if [ -z "$GPUS" ]; then
  # no nvidia-smi (some containers): ask torch
  GPUS=$(timeout "$B_GPUS" "$PYTHON" -c 'import torch
if torch.cuda.is_available():
    for i in range(torch.cuda.device_count()):
        print(f"{i}, {torch.cuda.get_device_name(i)}")' 2>/dev/null)
  if [ $? -eq 124 ]; then
    section "Result: no answer"
    echo "\`$PYTHON\` did not say within ${B_GPUS} s whether torch sees a GPU." >>"$REPORT"
    say "torch did not answer within ${B_GPUS} s; report: $REPORT"
    exit 1
  fi
fi
if [ -z "$GPUS" ]; then
  section "Result: no GPU found"
  echo "No NVIDIA GPU was found on this machine (no \`nvidia-smi\` listing a GPU, and" >>"$REPORT"
  echo "\`torch.cuda.is_available()\` is not True for \`$PYTHON\`). Nothing was installed," >>"$REPORT"
  echo "tested or measured: run this script on a machine with a GPU. On one, it would have" >>"$REPORT"
  echo "run these steps, each held to its budget:" >>"$REPORT"
  echo >>"$REPORT"
  plan_table >>"$REPORT"
  say "no GPU found; report: $REPORT"
  rm -rf "$WORK"
  exit 0
fi
NGPU=$(echo "$GPUS" | grep -c .)
section "GPUs"
echo "$GPUS" | sed 's/^/- /' >>"$REPORT"
STEPS+=("| find the GPUs | $B_GPUS | $(( $(date +%s) - START )) | ok: $NGPU GPU(s) |")
"$PYTHON" -c 'import torch, sys
print(f"- Python {sys.version.split()[0]}, torch {torch.__version__}, CUDA {torch.version.cuda}")' \
  >>"$REPORT" 2>&1
STATUS=0

# ------------------------------------------------------------------ 2. install
if [[ $SKIP != *,install,* ]]; then
  run_step "install" "$B_INSTALL" "$WORK/install.log" \
    "$PYTHON" -m pip install -q --no-deps --no-build-isolation --no-index \
    --target "$WORK/site" "$ROOT"
  section "Install: $STEP_RESULT"
  if [ "$STEP_RESULT" = ok ]; then
    PYTHONPATH="$WORK/site" "$PYTHON" -c 'import poptorch, os
print(f"- `pip install --no-deps --no-build-isolation --no-index` gave poptorch {poptorch.__version__} (torch untouched)")
print("- the poprun script:", "present" if os.path.exists(os.path.join(os.environ["PYTHONPATH"], "bin", "poprun")) else "MISSING")' \
      >>"$REPORT" 2>&1
  else
    echo "The offline install failed; the steps below run the checkout from PYTHONPATH:" >>"$REPORT"
    tail -n 15 "$WORK/install.log" >"$WORK/install.tail"; fence "$WORK/install.tail"
    STATUS=1
  fi
  echo "- the steps below run this checkout: PYTHONPATH=$ROOT/src" >>"$REPORT"
else
  STEPS+=("| install | $B_INSTALL | 0 | skipped (GPU_CHECK_SKIP) |")
fi
if [ "$DRY_RUN" != 1 ] && \
   ! "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "- torch of $PYTHON does not see the GPU: stopping here." >>"$REPORT"
  say "torch does not see the GPU; report: $REPORT"
  exit 1
fi

# ------------------------------------------------------------------ 3. tests
if [[ $SKIP != *,tests,* ]]; then
  export GPU_CHECK_PROGRESS="$WORK/tests.progress" POPTORCH_TEST_DEVICE=$TEST_DEVICE
  # shellcheck disable=SC2086
  run_step "tests on $TEST_DEVICE" "$B_TESTS" "$WORK/tests.log" \
    "$PYTHON" -m pytest -q -rfEs -p no:randomly -p no:cacheprovider -p gpu_check_progress \
    $TESTS
  TESTS_RC=$?
  unset POPTORCH_TEST_DEVICE
  section "Tests (POPTORCH_TEST_DEVICE=$TEST_DEVICE): $STEP_RESULT"
  echo "Summary: \`$(grep -E '(passed|failed|error|no tests ran)' "$WORK/tests.log" | tail -n 1)\`" >>"$REPORT"
  echo >>"$REPORT"
  grep -E '^(FAILED|ERROR) ' "$WORK/tests.log" | head -n 100 >"$WORK/failed.txt" || true
  if [ -s "$WORK/failed.txt" ]; then
    echo "Failures (first 100):" >>"$REPORT"; fence "$WORK/failed.txt"
  fi
  grep -E '^SKIPPED ' "$WORK/tests.log" | head -n 40 >"$WORK/skipped.txt" || true
  if [ -s "$WORK/skipped.txt" ]; then
    echo "Skipped (first 40):" >>"$REPORT"; fence "$WORK/skipped.txt"
  fi
  if [ "$TESTS_RC" -eq 124 ]; then
    # collected but not finished: what the budget cut
    sed -n 's/^collected //p' "$GPU_CHECK_PROGRESS" 2>/dev/null | sort >"$WORK/collected.txt"
    sed -n 's/^done //p' "$GPU_CHECK_PROGRESS" 2>/dev/null | sort -u >"$WORK/done.txt"
    comm -23 "$WORK/collected.txt" "$WORK/done.txt" >"$WORK/tests_not_run.txt"
    COUNT=$(grep -c . "$WORK/tests_not_run.txt")
    echo >>"$REPORT"
    echo "Stopped at the budget: $COUNT of $(grep -c . "$WORK/collected.txt") collected tests did not run (all listed):" >>"$REPORT"
    fence "$WORK/tests_not_run.txt"
    NOT_RUN+=("$COUNT tests (listed under Tests)")
  elif [ "$TESTS_RC" -ne 0 ]; then
    STATUS=1
  fi
else
  STEPS+=("| tests on cuda | $B_TESTS | 0 | skipped (GPU_CHECK_SKIP) |")
fi

# ------------------------------------------------------------------ 4. benchmarks
bench_section() {  # NAME SECTION BUDGET
  local name=$1 key=$2 budget=$3 part="$WORK/bench_$2.md" progress="$WORK/bench_$2.progress"
  run_step "$name" "$budget" "$WORK/bench_$key.log" \
    "$PYTHON" "$ROOT/benchmarks/gpu_bench.py" "${BENCH_ARGS[@]}" --sections "$key" \
    --output "$part" --progress "$progress"
  local rc=$?
  [ -f "$part" ] && cat "$part" >>"$REPORT"
  if [ "$rc" -eq 124 ]; then
    sed -n 's/^plan //p' "$progress" 2>/dev/null | sort >"$WORK/plan_$key.txt"
    sed -n 's/^done //p' "$progress" 2>/dev/null | sort -u >"$WORK/done_$key.txt"
    comm -23 "$WORK/plan_$key.txt" "$WORK/done_$key.txt" >"$WORK/not_run_$key.txt"
    [ -s "$WORK/plan_$key.txt" ] || \
      echo "all of it (stopped before it had listed its rows)" >"$WORK/not_run_$key.txt"
    [ -s "$WORK/not_run_$key.txt" ] || \
      echo "nothing: every row was measured (stopped while ending)" >"$WORK/not_run_$key.txt"
    printf '\nStopped at the budget (%s s); not measured:\n' "$budget" >>"$REPORT"
    fence "$WORK/not_run_$key.txt"
    NOT_RUN+=("$name: $(paste -sd, "$WORK/not_run_$key.txt" | sed 's/,/, /g')")
  elif [ "$rc" -ne 0 ]; then
    STATUS=1
    echo "gpu_bench.py failed (exit $rc):" >>"$REPORT"
    tail -n 30 "$WORK/bench_$key.log" >"$WORK/bench_$key.tail"; fence "$WORK/bench_$key.tail"
  fi
}
if [[ $SKIP != *,bench,* ]]; then
  section "Benchmarks"
  bench_section "benchmark: throughput" workloads "$B_WORKLOADS"
  bench_section "benchmark: GPT-2 small bf16" gpt2 "$B_GPT2"
  if [ "$NGPU" -ge 2 ]; then
    bench_section "benchmark: torchrun + NCCL" ddp "$B_DDP"
  else
    printf '\n## torchrun + NCCL: skipped\n\nNeeds 2 GPUs; this machine has %s.\n' "$NGPU" >>"$REPORT"
    STEPS+=("| benchmark: torchrun + NCCL | $B_DDP | 0 | skipped: needs 2 GPUs, $NGPU found |")
    NOT_RUN+=("benchmark: torchrun + NCCL (needs 2 GPUs, $NGPU found)")
  fi
  # peak memory by tensor location: torchrun over the GPUs with 2 or more (the script
  # counts them); with one the RTS row says it needs 2 and only it is skipped
  run_step "benchmark: peak GPU memory" "$B_MEMORY" "$WORK/bench_memory.log" \
    "$PYTHON" "$ROOT/benchmarks/gpu_memory_check.py" ${MEMORY_ARGS[@]+"${MEMORY_ARGS[@]}"} \
    --output "$WORK/bench_memory.md"
  MEMORY_RC=$?
  printf '\n' >>"$REPORT"
  [ -f "$WORK/bench_memory.md" ] && cat "$WORK/bench_memory.md" >>"$REPORT"
  if [ "$MEMORY_RC" -eq 124 ]; then
    printf '\nStopped at the budget (%s s); not measured: the memory table.\n' "$B_MEMORY" \
      >>"$REPORT"
    NOT_RUN+=("benchmark: peak GPU memory (stopped at the budget)")
  elif [ "$MEMORY_RC" -ne 0 ]; then
    STATUS=1
    echo "gpu_memory_check.py failed (exit $MEMORY_RC):" >>"$REPORT"
    tail -n 30 "$WORK/bench_memory.log" >"$WORK/bench_memory.tail"
    fence "$WORK/bench_memory.tail"
  fi
else
  STEPS+=("| benchmarks | - | 0 | skipped (GPU_CHECK_SKIP) |")
fi

# ------------------------------------------------------------------ summary
section "Steps ($SIZE: $(( $(date +%s) - START )) s of ${TOTAL} s)"
{
  echo "| step | budget (s) | used (s) | result |"
  echo "| --- | --- | --- | --- |"
  printf '%s\n' "${STEPS[@]}"
  echo
  if [ ${#NOT_RUN[@]} -gt 0 ]; then
    echo "Did not run:"
    printf -- '- %s\n' "${NOT_RUN[@]}"
  else
    echo "Everything ran."
  fi
} >>"$REPORT"
section "Logs"
echo "Full logs: \`$WORK\` ($NGPU GPU(s))." >>"$REPORT"
say "done (status $STATUS) in $(( $(date +%s) - START )) s; report: $REPORT"
exit $STATUS
