#!/usr/bin/env bash
# Creates (or refreshes) the project's virtual environment in .venv: every
# package from requirements/dev.txt (exact versions, sha256 hashes: the CPU
# torch, the dev tools, the hf extra), then Isthmus itself in editable mode.
# The same lock gives the same environment on any day; refresh it with
# `bash scripts/lock.sh`.
#
# The CPU torch wheel (torch==X+cpu) comes from PyTorch's index. Where pip's
# own configuration finds it (a find-links folder, as on this project's
# machines), nothing more is needed; elsewhere set
#   ISTHMUS_TORCH_INDEX=https://download.pytorch.org/whl/cpu
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
LOCK=requirements/dev.txt
PIP=(--quiet --disable-pip-version-check)

if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv with $($PYTHON --version)"
  "$PYTHON" -m venv .venv
fi
PY=.venv/bin/python

# Install again only when the lock or pyproject.toml changed since the last
# install (by content: a fresh clone's file times say nothing).
stamp=.venv/.isthmus-installed
want=$(cat "$LOCK" pyproject.toml | sha256sum | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "setup: installing $LOCK (torch CPU, dev tools, hf extra; hashes checked)"
  index=()
  [ -n "${ISTHMUS_TORCH_INDEX:-}" ] && index=(--extra-index-url "$ISTHMUS_TORCH_INDEX")
  "$PY" -m pip install "${PIP[@]}" --require-hashes ${index[@]+"${index[@]}"} -r "$LOCK"
  echo "setup: installing isthmus (editable)"
  # Its build needs setuptools and wheel, which the lock holds: no isolated
  # build environment that would fetch unlocked ones.
  "$PY" -m pip install "${PIP[@]}" --no-deps --no-build-isolation -e .
  echo "$want" > "$stamp"
fi
