#!/usr/bin/env bash
# Creates (or refreshes) the project's virtual environment in .venv and installs
# Isthmus into it in editable mode, with the test and lint tools.
#
# The CPU build of torch is installed explicitly first: a plain `torch`
# requirement would otherwise pull a multi-GB CUDA build from PyPI.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
TORCH_VERSION=${ISTHMUS_TORCH_VERSION:-2.13.0}

if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv with $($PYTHON --version)"
  "$PYTHON" -m venv .venv
fi
PY=.venv/bin/python

if ! "$PY" -c 'import torch' >/dev/null 2>&1; then
  echo "setup: installing torch==$TORCH_VERSION (CPU wheel)"
  "$PY" -m pip install --quiet --disable-pip-version-check "torch==$TORCH_VERSION"
fi

# Re-install only when pyproject.toml changed since the last install.
stamp=.venv/.isthmus-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  echo "setup: installing isthmus (editable) with dev extras"
  "$PY" -m pip install --quiet --disable-pip-version-check -e '.[dev]'
  touch "$stamp"
fi
