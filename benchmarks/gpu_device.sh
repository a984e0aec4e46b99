#!/usr/bin/env bash
# benchmarks/gpu.py on a lent GPU machine that has torch but none of Isthmus's
# other packages and no network: installs the wheels carried in .whl/ (see
# docs/gpu.md, "Running the GPU benchmark on a bare machine"), makes the isthmus.*
# namespace importable from this checkout without building it, then runs the
# parts in groups, each under its own time limit so that one slow part cannot
# take the others' figures with it. Everything lands in $OUT (default: runs/gpu/).
#
#   bash benchmarks/gpu_device.sh --wheels   # here, with pip and PyPI: fill .whl/
#   bash benchmarks/gpu_device.sh            # there: every part
#   GPU_RUNS=3 bash benchmarks/gpu_device.sh # more isthmus run / plain loop pairs
#   GPU_GROUPS="exchange inner" bash benchmarks/gpu_device.sh  # some groups only
# The machine's copy of .git can be stale: name the commit sent, e.g.
#   ISTHMUS_COMMIT=$(git rev-parse HEAD) written literally into the device command.
set -uo pipefail
cd "$(dirname "$0")/.."

# What the GPU image (torch, grpcio, protobuf, pyyaml, rich, matplotlib, ...) lacks,
# as CPython 3.12 x86-64 wheels. argon2-cffi: amqtt's authentication plugin imports
# pwdlib's argon2 hasher, and without it the embedded broker does not start.
WHEELS="zstandard==0.25.0 aiomqtt==2.5.1 paho-mqtt==2.2.0 amqtt==0.12.1 dacite==1.9.2
pwdlib==0.3.1 argon2-cffi==25.1.0 argon2-cffi-bindings==26.2.0 transitions==0.9.3
websockets==17.4 ruamel.yaml==0.19.1 cryptography==50.0.2 cffi==2.1.1 pycparser==3.12
tensorboardX==2.6.5 grpcio-health-checking==1.85.1 protobuf==7.36.2 grpcio==1.85.3"
if [ "${1:-}" = "--wheels" ]; then
    grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >>.git/info/exclude
    # shellcheck disable=SC2086
    exec python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp -d .whl --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
        --platform manylinux_2_26_x86_64 --platform manylinux1_x86_64 $WHEELS
fi
OUT=${OUT:-runs/gpu}
mkdir -p "$OUT"
started=$(date +%s)
stamp() { echo "[device $(($(date +%s) - started))s] $*"; }

if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/isthmus-site .whl/*.whl || { echo "wheel install failed"; exit 3; }
    export PYTHONPATH=/tmp/isthmus-site${PYTHONPATH:+:$PYTHONPATH}
fi
# The isthmus.* namespace as pyproject.toml maps it (isthmus.intra is intra/, ...),
# linked inside this copy of the checkout: a python started here finds ./isthmus first.
for d in job intra inter proto sim deploy; do [ -e "isthmus/$d" ] || ln -s "../$d" "isthmus/$d"; done
export PYTHONPATH=$PWD:$PYTHONPATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv \
    >"$OUT/machine.txt" 2>&1
python3 -c "import torch, grpc, google.protobuf as p; print('torch', torch.__version__, \
'cuda', torch.version.cuda, 'grpc', grpc.__version__, 'protobuf', p.__version__)" \
    >>"$OUT/machine.txt" 2>&1
nproc >>"$OUT/machine.txt"
cat "$OUT/machine.txt"
python3 -c "import isthmus.inter.peer, isthmus.deploy.cli, isthmus.deploy.launch" || { echo "import failed"; exit 4; }

part() {  # part SECONDS NAME ARGS...: one group of benchmarks/gpu.py's parts
    local limit=$1 name=$2
    shift 2
    stamp "$name (limit ${limit}s)"
    timeout --signal=INT --kill-after=15 "$limit" \
        python3 benchmarks/gpu.py --json "$OUT/gpu-$name.json" "$@" 2>&1 | tee "$OUT/gpu-$name.log"
    stamp "$name exit ${PIPESTATUS[0]}"
}
groups=" ${GPU_GROUPS:-exchange inner sites tests} "
[[ $groups == *" exchange "* ]] && part "${GPU_LIMIT_EXCHANGE:-160}" exchange --only codecs,exchange
[[ $groups == *" inner "* ]] && part "${GPU_LIMIT_INNER:-210}" inner --only inner --runs "${GPU_RUNS:-2}"
[[ $groups == *" sites "* ]] && part "${GPU_LIMIT_SITES:-140}" sites --only shared,two-ranks
if [[ $groups == *" tests "* ]]; then
    stamp "CUDA tests"
    timeout 150 python3 -m pytest -q -p no:cacheprovider -o addopts= \
        tests/test_codecs_device.py tests/test_devices.py tests/test_step_path.py 2>&1 | tail -25 >"$OUT/pytest.log"
    cat "$OUT/pytest.log"
fi
stamp "done"
