#!/usr/bin/env bash
# Runs every check CI runs: set-up (.venv), lint, then the whole test suite.
# Extra arguments go to pytest, e.g. the fast tests alone:
#   bash scripts/test.sh -m "not slow"
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
echo "test: ruff"
.venv/bin/ruff check .
echo "test: generated protocol code"
.venv/bin/python scripts/gen_proto.py --check
echo "test: pytest"
exec .venv/bin/python -m pytest "$@"
