#!/usr/bin/env bash
# Refreshes the dependency locks in requirements/ from pyproject.toml: exact
# versions and sha256 hashes of every package, for CPython 3.11 on Linux x86_64.
#
#   bash scripts/lock.sh              # resolve again at today's newest releases
#   bash scripts/lock.sh --check      # exit 1 if a lock no longer matches pyproject.toml
#
# - requirements/dev.txt: the package, its dev tools and the hf extra, with the
#   CPU torch (scripts/setup.sh installs it: every test's needs);
# - requirements/runtime.txt: the package alone, with the CPU torch (the CPU image);
# - requirements/runtime-cuda.txt: the package alone, with PyPI's CUDA torch (the
#   CUDA image).
# The lock's torch pin is requirements/torch-{cpu,cuda}.in. Commit the locks with
# the change that needed them; CI and the images install nothing else.
#
# Why compiled requirements files (uv pip compile) rather than uv.lock: pip,
# which every machine has, installs them with --require-hashes, and honours the
# machine's own pip settings (on this project's machines the CPU torch wheel
# comes from a local find-links folder; uv's installer looks at neither).
# uv only resolves: it is quick and writes every file's hash.
set -euo pipefail
cd "$(dirname "$0")/.."
UV_VERSION=0.13.10
PY=.venv/bin/python
[ -x "$PY" ] || { echo "lock: no .venv; run: bash scripts/setup.sh" >&2; exit 2; }
if ! "$PY" -m uv --version 2>/dev/null | grep -q " $UV_VERSION"; then
  "$PY" -m pip install --quiet --disable-pip-version-check "uv==$UV_VERSION"
fi

check=0
[ "${1:-}" = --check ] && check=1
# Where the CPU torch wheel can be found: PyTorch's index, and a local
# find-links folder where the machine's pip configuration names one.
links=(--find-links https://download.pytorch.org/whl/cpu/torch/)
local_links=$("$PY" -m pip config get global.find-links 2>/dev/null || true)
[ -n "$local_links" ] && [ -d "$local_links" ] && links=(--find-links "$local_links")

compile() {  # compile OUT TORCH_IN [EXTRA...]
  local out=$1 torch=$2; shift 2
  local extras=()
  for extra in "$@"; do extras+=(--extra "$extra"); done
  local target=$out mode=(--upgrade)
  if [ "$check" = 1 ]; then target=$(mktemp); cp "$out" "$target"; mode=(); fi
  "$PY" -m uv pip compile --quiet pyproject.toml ${extras[@]+"${extras[@]}"} \
    --override "$torch" --generate-hashes --python-version 3.11 ${mode[@]+"${mode[@]}"} \
    --python-platform x86_64-manylinux_2_28 --no-header --annotation-style line \
    ${links[@]+"${links[@]}"} --output-file "$target"
  if [ "$check" = 1 ]; then
    # --check keeps the pins the lock has (uv prefers them), so a difference means
    # pyproject.toml asks for something the lock lacks.
    if ! diff -q "$out" "$target" >/dev/null; then
      echo "lock: $out does not match pyproject.toml; run: bash scripts/lock.sh" >&2
      rm -f "$target"; return 1
    fi
    rm -f "$target"
  fi
}

compile requirements/dev.txt requirements/torch-cpu.in dev hf
compile requirements/runtime.txt requirements/torch-cpu.in
links=()  # the CUDA build is PyPI's own
compile requirements/runtime-cuda.txt requirements/torch-cuda.in
[ "$check" = 1 ] && echo "lock: requirements/*.txt match pyproject.toml" \
  || echo "lock: wrote requirements/dev.txt, runtime.txt, runtime-cuda.txt"
