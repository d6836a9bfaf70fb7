#!/usr/bin/env bash
# The test suite on the newest torch release we support (pyproject.toml: torch>=2.13,<2.15;
# .ci/run tests 2.13.0). Makes its own virtual environment (.venv-torch-newest, a large
# download: torch and its dependencies), installs the project into it and runs the lint,
# the private-torch-names check and the whole suite.
#
#   scripts/test_newest_torch.sh            # torch 2.14.1
#   TORCH_VERSION=2.14.0 scripts/test_newest_torch.sh
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH_VERSION="${TORCH_VERSION:-2.14.1}"
VENV="${VENV:-.venv-torch-newest}"
python3 -m venv "$VENV"
"$VENV/bin/pip" install -q "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}"
"$VENV/bin/pip" install -q -e ".[test,examples,lint]"
"$VENV/bin/python" -c "import torch; print('torch', torch.__version__)"
# The private torch names first: a removed one is named here, not deep in a model run.
"$VENV/bin/python" -m pytest -q tests/test_torch_internals.py
"$VENV/bin/ruff" check src
"$VENV/bin/mypy" src/poptorch
"$VENV/bin/python" -m pytest -q "$@"
