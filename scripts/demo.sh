#!/usr/bin/env bash
# The main job, from a fresh machine: set up .venv, then train one model across
# three emulated continents (isthmus run), with live progress and a report.
# Extra arguments go to `isthmus run`, e.g. --strategy streaming --steps 300
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/isthmus run deploy/examples/three-continents.yaml "$@"
