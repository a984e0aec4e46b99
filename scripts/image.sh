#!/usr/bin/env bash
# Builds the sites' image from deploy/images/Dockerfile, with exactly the locked
# packages: it makes the build context (the lock, every wheel it pins, fetched
# here with hashes checked, and Isthmus's own wheel), then runs the engine.
#
#   bash scripts/image.sh [--cuda] [--base IMAGE] [--tag TAG] [--engine podman|docker]
#
# --cuda     PyPI's CUDA torch (requirements/runtime-cuda.txt): isthmus:latest-cuda
# --base     the image to build FROM (default python:3.11-slim; any Python 3.11 with
#            venv, e.g. the local base scripts/containers.sh makes where no
#            registry is reachable)
# --tag      the image's name (default isthmus:latest, or isthmus:latest-cuda)
# The wheels are fetched on this machine, not in the build: pip's own settings
# here decide where the CPU torch comes from (PyPI's Linux torch is the CUDA
# build; set PIP_FIND_LINKS=https://download.pytorch.org/whl/cpu/torch/ where
# nothing else provides the CPU wheel). Prints the image's size at the end.
set -euo pipefail
cd "$(dirname "$0")/.."

lock=requirements/runtime.txt tag="" base="" engine=${ENGINE:-} flavour=cpu
while [ $# -gt 0 ]; do
  case "$1" in
    --cuda) lock=requirements/runtime-cuda.txt flavour=cuda; shift ;;
    --base) base=$2; shift 2 ;;
    --tag) tag=$2; shift 2 ;;
    --engine) engine=$2; shift 2 ;;
    *) echo "image: unknown argument $1; see the header of $0" >&2; exit 2 ;;
  esac
done
[ -n "$tag" ] || { [ $flavour = cuda ] && tag=isthmus:latest-cuda || tag=isthmus:latest; }
if [ -z "$engine" ]; then
  engine=$(command -v podman || command -v docker || true)
  [ -n "$engine" ] || { echo "image: neither podman nor docker is installed" >&2; exit 2; }
fi
PY=.venv/bin/python
[ -x "$PY" ] || { echo "image: no .venv; run: bash scripts/setup.sh" >&2; exit 2; }
if [ "$(basename "$engine")" = podman ] && [ -z "${CONTAINERS_CONF:-}" ] \
    && [ -f .containers/containers.conf ]; then
  export CONTAINERS_CONF=$PWD/.containers/containers.conf
fi

context=build/image-$flavour
mkdir -p "$context/wheels"
stamp="$context/wheels/.lock-sha256"
want=$(sha256sum "$lock" | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "image: fetching the wheels $lock pins into $context/wheels (hashes checked)"
  "$PY" -m pip download --quiet --disable-pip-version-check --no-deps --require-hashes \
    --only-binary=:all: -r "$lock" -d "$context/wheels"
  # Wheels of pins the lock no longer has would only grow the context.
  "$PY" - "$lock" "$context/wheels" <<'PYEOF'
import re, sys
from pathlib import Path
from packaging.utils import canonicalize_name, parse_wheel_filename
lock, folder = Path(sys.argv[1]), Path(sys.argv[2])
pinned = {canonicalize_name(n): v for n, v in re.findall(r"^([A-Za-z0-9._-]+)==(\S+)", lock.read_text(), re.M)}
for wheel in folder.glob("*.whl"):
    name, version, *_ = parse_wheel_filename(wheel.name)
    if str(version) != pinned.get(name):
        wheel.unlink()
PYEOF
  echo "$want" > "$stamp"
fi
rm -rf "$context/isthmus"
echo "image: building Isthmus's wheel"
"$PY" -m pip wheel --quiet --disable-pip-version-check --no-deps --no-build-isolation \
  -w "$context/isthmus" . >/dev/null
cp "$lock" "$context/requirements.lock"

echo "image: $engine build -t $tag${base:+ (FROM $base)}"
"$engine" build --quiet -f deploy/images/Dockerfile ${base:+--build-arg "BASE=$base"} \
  -t "$tag" "$context" >/dev/null
size=$("$engine" image inspect --format '{{.Size}}' "$tag")
echo "image: built $tag, $((size / 1000000)) MB"
