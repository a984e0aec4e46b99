#!/usr/bin/env bash
# The main job, from a fresh machine: set up .venv, then run the emulated-WAN demo
# (one transatlantic link: measured round trip and throughput).
# Extra arguments go to `isthmus wan demo`, e.g. --preset transpacific --loss 0.001
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/isthmus wan demo "$@"
