#!/usr/bin/env bash
# The whole test suite on each supported torch release (pyproject.toml: torch>=2.11,<2.16),
# one virtual environment per release, then a results table: passed / failed / skipped /
# errors / time of each (docs/supported-releases.md keeps the last one).
#
#   scripts/test_torch_range.sh                          # 2.11.0 2.12.1 2.13.0 2.14.1 2.15.0
#   scripts/test_torch_range.sh 2.11.0 2.15.0            # these releases only
#   scripts/test_torch_range.sh 2.15.0 -- tests/test_ops.py -x    # pytest arguments after --
#
# Environment:
#   TORCH_RANGE_DIR   where the environments live (outside the repository; default
#                     ~/.cache/openpoptorch/torch-range): venv-torch-<release>, reused when
#                     its torch is already that release; the logs: torch-<release>.log
#   PYTHON            the interpreter the environments are made from (default python3)
#   TORCH_INDEX_URL   another index for torch itself (e.g. the CPU builds); default: the
#                     registry's build (with CUDA libraries: about 3 GB per release)
#   TORCH_RANGE_TABLE also write the table (Markdown) to this file
# A pip constraint that caps torch (some machines cap it at the releases on their disk)
# is lifted for these installs (PIP_CONSTRAINT=/dev/null). The releases run one after
# the other, never at once. Exit status: 0 when every release's suite passed.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
RELEASES=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do RELEASES+=("$1"); shift; done
[ "${1:-}" = "--" ] && shift
[ ${#RELEASES[@]} -gt 0 ] || RELEASES=(2.11.0 2.12.1 2.13.0 2.14.1 2.15.0)
DIR=${TORCH_RANGE_DIR:-$HOME/.cache/openpoptorch/torch-range}
PYTHON=${PYTHON:-python3}
mkdir -p "$DIR"
say() { echo "test_torch_range: $*" >&2; }

# pytest's closing line ("== 3 failed, 1370 passed, 6 skipped in 540.12s ==") -> one count
count() { grep -oE "[0-9]+ $1" <<<"$2" | head -n 1 | grep -oE '^[0-9]+' || echo 0; }

ROWS=()
STATUS=0
for RELEASE in "${RELEASES[@]}"; do
  VENV=$DIR/venv-torch-$RELEASE
  LOG=$DIR/torch-$RELEASE.log
  HAVE=$("$VENV/bin/python" -c 'import torch; print(torch.__version__.split("+")[0])' 2>/dev/null)
  if [ "$HAVE" != "$RELEASE" ]; then
    say "torch $RELEASE: making $VENV"
    INDEX=()
    [ -n "${TORCH_INDEX_URL:-}" ] && INDEX=(--index-url "$TORCH_INDEX_URL")
    if ! { "$PYTHON" -m venv "$VENV" &&
           PIP_CONSTRAINT=/dev/null "$VENV/bin/pip" install -q "torch==$RELEASE" "${INDEX[@]}"; } \
         >"$LOG" 2>&1; then
      say "torch $RELEASE: install failed (see $LOG)"
      ROWS+=("| $RELEASE | install failed | | | | | |")
      STATUS=1
      continue
    fi
  fi
  # the project and its test dependencies; torch stays the release just installed
  if ! PIP_CONSTRAINT=/dev/null "$VENV/bin/pip" install -q -e "$ROOT[test,examples,geometric]" \
       "torch==$RELEASE" >>"$LOG" 2>&1; then
    say "torch $RELEASE: installing the project failed (see $LOG)"
    ROWS+=("| $RELEASE | install failed | | | | | |")
    STATUS=1
    continue
  fi
  PYVER=$("$VENV/bin/python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
  TORCH=$("$VENV/bin/python" -c 'import torch; print(torch.__version__)')
  say "torch $TORCH (Python $PYVER): pytest ${*:-(the whole suite)} (log: $LOG)"
  START=$(date +%s)
  (cd "$ROOT" && "$VENV/bin/python" -m pytest -q -p no:cacheprovider "$@") >>"$LOG" 2>&1
  RC=$?
  SECONDS_TAKEN=$(( $(date +%s) - START ))
  LAST=$(grep -E '(passed|failed|error|skipped|no tests ran)' "$LOG" | tail -n 1)
  TIME=$(printf '%d min %02d s' $((SECONDS_TAKEN / 60)) $((SECONDS_TAKEN % 60)))
  ROWS+=("| $TORCH | $PYVER | $(count passed "$LAST") | $(count failed "$LAST") | $(count skipped "$LAST") | $(count error "$LAST") | $TIME |")
  if [ "$RC" -ne 0 ]; then
    STATUS=1
    grep -E '^(FAILED|ERROR) ' "$LOG" | head -n 50 >&2
  fi
  say "torch $TORCH: $LAST"
done

TABLE=$(
  echo "| torch | Python | passed | failed | skipped | errors | time |"
  echo "| --- | --- | --- | --- | --- | --- | --- |"
  printf '%s\n' "${ROWS[@]}"
)
echo "$TABLE"
[ -n "${TORCH_RANGE_TABLE:-}" ] && echo "$TABLE" >"$TORCH_RANGE_TABLE"
exit $STATUS
