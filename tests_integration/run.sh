#!/usr/bin/env bash
# Libraries built on PopTorch, run against this checkout (issue 17). Opt-in: not part of
# the default test run (pytest's testpaths is tests/). Creates one virtual environment per
# library with the pinned versions, then runs our comparison tests and the libraries' own
# tests that need no network.
#
#   tests_integration/run.sh [lightning|optimum|all]      (default: all)
#
# Environment: INTEGRATION_DIR (default /tmp/openpoptorch-integration) holds the
# environments and logs; LIGHTNING_GRAPHCORE_SRC / OPTIMUM_GRAPHCORE_SRC: a source checkout
# (git work tree or bare repository) of lightning-graphcore / optimum-graphcore whose
# tests/ folder is run at tag v0.1.0 / v0.7.1 (their wheels carry no tests); skipped with
# a message when unset.
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
DIR="${INTEGRATION_DIR:-/tmp/openpoptorch-integration}"
WHICH="${1:-all}"
mkdir -p "$DIR"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1

make_env() {  # name, then the pinned requirements
  local env="$DIR/$1"; shift
  if [ ! -x "$env/bin/python" ]; then
    python3 -m venv "$env"
    "$env/bin/pip" install -q torch==2.13.0          # first: the CPU build, no CUDA pull
    "$env/bin/pip" install -q -e "$REPO" -e "$REPO/compat/popart"
    "$env/bin/pip" install -q pytest pytest-timeout "$@"
  fi
}

checkout_tests() {  # source, tag, destination
  local src="$1" tag="$2" dest="$3"
  rm -rf "$dest" && mkdir -p "$dest"
  if [ -d "$src/.git" ]; then git -C "$src" archive "$tag" | tar x -C "$dest"
  else git --git-dir "$src" archive "$tag" | tar x -C "$dest"; fi
}

run_lightning() {
  # lightning 2.0.9 imports pkg_resources (setuptools < 81); torch wants setuptools >= 77
  # pytest < 8: lightning-graphcore's tests use pytest.warns(None), removed in pytest 8
  make_env lightning lightning==2.0.9 lightning-graphcore==0.1.0 "setuptools>=77,<81" \
    "scikit-learn>0.22.1,<1.4.0" "torchmetrics>=0.8.0,<1.3.0" "pytest<8"
  (cd "$REPO" && "$DIR/lightning/bin/python" -m pytest tests_integration/lightning \
     -p no:cacheprovider -q -rA)
  if [ -n "${LIGHTNING_GRAPHCORE_SRC:-}" ]; then
    checkout_tests "$LIGHTNING_GRAPHCORE_SRC" v0.1.0 "$DIR/lightning-graphcore-src"
    # their config turns FutureWarning into errors; lightning 2.0.9's own _pytree.py
    # triggers one under torch 2.13 (LeafSpec), which has nothing to do with PopTorch
    (cd "$DIR/lightning-graphcore-src" && "$DIR/lightning/bin/python" -m pytest tests \
       -p no:cacheprovider -q -rA -W "ignore::FutureWarning") || true
  else
    echo "LIGHTNING_GRAPHCORE_SRC unset: lightning-graphcore's own tests not run"
  fi
}

run_optimum() {
  # datasets/pyarrow pinned to releases that accept the numpy optimum-graphcore pins
  make_env optimum optimum-graphcore==0.7.1 transformers==4.29.2 datasets==2.14.7 \
    pyarrow==14.0.2 "setuptools>=77,<81" parameterized psutil filelock GitPython
  (cd "$REPO" && "$DIR/optimum/bin/python" -m pytest tests_integration/optimum \
     -p no:cacheprovider -q -rA)
  if [ -n "${OPTIMUM_GRAPHCORE_SRC:-}" ]; then
    checkout_tests "$OPTIMUM_GRAPHCORE_SRC" v0.7.1 "$DIR/optimum-graphcore-src"
    # the tests that need no network (the others download models or data sets).
    # transformers 4.29 resumes checkpoints with torch.load's old default (weights_only
    # became True in torch 2.6): the variable restores it for those tests
    (cd "$DIR/optimum-graphcore-src" && TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1 \
       "$DIR/optimum/bin/python" -m pytest tests/test_ipu_configuration.py \
       tests/test_trainer.py -p no:cacheprovider -q -rA --timeout 1800) || true
  else
    echo "OPTIMUM_GRAPHCORE_SRC unset: optimum-graphcore's own tests not run"
  fi
}

case "$WHICH" in
  lightning) run_lightning ;;
  optimum) run_optimum ;;
  all) run_lightning; run_optimum ;;
  *) echo "usage: $0 [lightning|optimum|all]" >&2; exit 2 ;;
esac
