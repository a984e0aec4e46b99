#!/usr/bin/env bash
# Runs every check CI runs: set-up (.venv from requirements/dev.txt), lint, the
# generated-code check, then the whole test suite. Extra arguments go to pytest,
# e.g. the fast tests alone:
#   bash scripts/test.sh -m "not slow"
#
# As root with apt (CI, a fresh VM), it first installs what the tests need beyond
# Python: Mosquitto and its clients (the control plane's real broker), Slurm and
# munge (the rendered batch scripts run on real daemons), libfaketime (a site
# whose clock is a minute off), podman and a locally
# made base image (scripts/containers.sh: the images are built and the sites run
# as containers). Elsewhere it runs what it can, and ends with one line per
# group of skipped tests: how many, why, and the command that enables them.
#
# Three passes. The tests that can share the machine (single-process ones, small
# two-rank sites) run on $ISTHMUS_TEST_WORKERS workers (default 2, pytest-xdist);
# then the slow multi-process runs (`slow`: whole jobs of several sites over the
# emulator) on as many workers, each worker taking the next test as it frees
# (worksteal: the slow tests differ tenfold in length; the longest first, by
# tests/durations.json); last, one at a time, the
# tests that must have the machine to themselves (`serial`: they measure the
# emulator's own timing or rate, start a Slurm cluster, of which two at once
# never finish their jobs, or build and run containers). A `-m EXPR` given here
# selects within every pass.
set -euo pipefail
cd "$(dirname "$0")/.."
# The suite starts hundreds of Python processes (ranks, sites, CLI commands), and
# each would compile the project's sources again where PYTHONDONTWRITEBYTECODE is
# set (about 0.3 CPU-s a rank, and 5 s of every pass's collection, whose asserts
# pytest rewrites): the bytecode goes to __pycache__/ (git ignores it).
unset PYTHONDONTWRITEBYTECODE
# One compute thread a process: two workers and their sites' ranks share the
# machine's cores, and torch's default (a thread per core in every process) spent
# a third of the CPU spinning OpenMP threads that had no core to run on (two
# multi-site tests: 134 CPU-s, 86 with one thread). `isthmus run` sets its ranks'
# count itself; this reaches the `isthmus site` processes and the workers.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"

if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  packages=()
  command -v mosquitto >/dev/null && command -v mosquitto_sub >/dev/null \
    || packages+=(mosquitto mosquitto-clients)
  { command -v slurmctld || [ -x /usr/sbin/slurmctld ]; } >/dev/null 2>&1 \
    || packages+=(slurm-wlm munge)
  command -v faketime >/dev/null || packages+=(faketime)  # a site's clock set off
  if [ ${#packages[@]} -gt 0 ]; then
    echo "test: installing ${packages[*]} (apt)"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
        --no-install-recommends "${packages[@]}" >/dev/null) \
      || echo "test: warning: could not install ${packages[*]}; their tests skip"
  fi
  bash scripts/containers.sh || echo "test: warning: podman is not ready; the container tests skip"
fi

bash scripts/setup.sh
echo "test: ruff"
.venv/bin/ruff check .
echo "test: generated protocol code"
.venv/bin/python scripts/gen_proto.py --check

selection=""
rest=()
while [ $# -gt 0 ]; do
  case "$1" in
    -m) selection="$2"; shift 2 ;;
    -m*) selection="${1#-m}"; shift ;;
    *) rest+=("$1"); shift ;;
  esac
done
within() { if [ -n "$selection" ]; then echo "($selection) and ($1)"; else echo "$1"; fi; }

ISTHMUS_SKIP_LOG=$(mktemp)
export ISTHMUS_SKIP_LOG
trap 'rm -f "$ISTHMUS_SKIP_LOG"' EXIT
status=0
echo "test: pytest, parallel pass (${ISTHMUS_TEST_WORKERS:-2} workers)"
.venv/bin/python -m pytest -n "${ISTHMUS_TEST_WORKERS:-2}" -m "$(within 'not slow and not serial')" \
  ${rest[@]+"${rest[@]}"} || status=$?
[ "$status" = 5 ] && status=0  # nothing selected in this pass
second=0
case "$selection" in
  # The fast tier: this pass would select nothing, after a collection of every
  # test module (about 13 s).
  "not slow") echo "test: pytest, slow multi-process runs: none selected" ;;
  *)
    echo "test: pytest, slow multi-process runs (${ISTHMUS_TEST_WORKERS:-2} workers)"
    ISTHMUS_LONGEST_FIRST=1 .venv/bin/python -m pytest -n "${ISTHMUS_TEST_WORKERS:-2}" --dist worksteal \
      -m "$(within 'slow and not serial')" ${rest[@]+"${rest[@]}"} || second=$?
    [ "$second" = 5 ] && second=0
    ;;
esac
echo "test: pytest, one at a time (serial)"
third=0
.venv/bin/python -m pytest -m "$(within 'serial')" ${rest[@]+"${rest[@]}"} || third=$?
[ "$third" = 5 ] && third=0
echo "test: what did not run here"
.venv/bin/python tests/needs.py "$ISTHMUS_SKIP_LOG" | sed 's/^/test: /'
if [ "$status" != 0 ]; then exit "$status"; fi
if [ "$second" != 0 ]; then exit "$second"; fi
exit "$third"
