#!/usr/bin/env bash
# Train one job across three sites that are separate hosts, started the way
# operators start real clusters: each site runs `isthmus site` on its own host,
# the broker runs on one of them, and every byte between hosts crosses an
# emulated WAN link (`isthmus wan up --hosts`: a network namespace per site
# behind a packet-level router). Nothing is shared between the sites but the
# job file and the certificates: no loopback, no files, no clock.
#
#   sudo scripts/separate_hosts.sh [OUT_DIR]     # needs root (network namespaces)
#
# Environment: ISTHMUS (the isthmus command; default: the one on PATH),
# STEPS (inner steps per site, default 40), PRESET (the links, default transatlantic).
# At the end it prints each site's parameter digest and exits 1 unless they agree.
set -euo pipefail

ISTHMUS=${ISTHMUS:-$(command -v isthmus || true)}
if [[ -z "$ISTHMUS" ]]; then
    echo "separate_hosts: no isthmus command; run scripts/setup.sh, or set ISTHMUS" >&2
    exit 2
fi
OUT=${1:-runs/separate-hosts-$(date +%Y%m%d-%H%M%S)}
STEPS=${STEPS:-40}
PRESET=${PRESET:-transatlantic}
MOSQUITTO=$(command -v mosquitto || echo /usr/sbin/mosquitto)
[[ -x "$MOSQUITTO" ]] || { echo "separate_hosts: mosquitto is not installed" >&2; exit 2; }

mkdir -p "$OUT"
cd "$OUT"
JOB=separate-hosts

say() { echo "separate_hosts: $*"; }

# The emulator gives the hosts 10.213.0.1, .2, .3 in the job file's order.
# Every site listens on all its host's addresses and tells the others the
# address they reach it at; the broker runs on site a's host.
cat > job.yaml <<EOF
name: $JOB
sites:
  - {name: a, ranks: 2, address: 0.0.0.0:7100, advertise: 10.213.0.1:7100}
  - {name: b, ranks: 1, address: 0.0.0.0:7100, advertise: 10.213.0.2:7100}
  - {name: c, ranks: 1, address: 0.0.0.0:7100, advertise: 10.213.0.3:7100}
wan:
  default: {preset: $PRESET}
train: {strategy: diloco, steps: $STEPS, sync_every: 10, warmup_steps: 5}
tls: {ca: certs/ca.crt, cert: "certs/{site}.crt", key: "certs/{site}.key"}
control:
  broker: mqtts://10.213.0.1:8883
  tls: {ca: certs/ca.crt, cert: "certs/{site}.crt", key: "certs/{site}.key"}
EOF

say "certificates: a job CA, one per site, one for the broker"
"$ISTHMUS" certs job.yaml --out certs --broker 10.213.0.1 > certs.log

pids=()
cleanup() {
    for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
    [[ -n "${WAN:-}" ]] && kill "$WAN" 2>/dev/null && wait "$WAN" 2>/dev/null || true
}
trap cleanup EXIT

say "hosts: one network namespace per site, links $PRESET"
"$ISTHMUS" wan up job.yaml --hosts --state wan.json > wan.log 2>&1 &
WAN=$!
for _ in $(seq 300); do
    grep -q '^ready' wan.log 2>/dev/null && break
    kill -0 "$WAN" 2>/dev/null || { cat wan.log >&2; exit 1; }
    sleep 0.1
done
grep -q '^ready' wan.log || { say "the emulator did not start"; cat wan.log >&2; exit 1; }
for site in a b c; do
    host=$(python3 -c "import json; print(json.load(open('wan.json'))['sites']['$site']['address'])")
    grep -q "advertise: $host:7100" job.yaml || {
        say "site $site's host is $host, not the address job.yaml advertises"; exit 1; }
done

say "broker: Mosquitto with mutual TLS on site a's host"
mkdir -p broker
cat > broker/mosquitto.conf <<EOF
listener 8883 10.213.0.1
cafile $PWD/certs/ca.crt
certfile $PWD/certs/broker.crt
keyfile $PWD/certs/broker.key
require_certificate true
use_identity_as_username true
allow_anonymous false
persistence false
user $(id -un)
EOF
"$ISTHMUS" wan exec job.yaml a -- "$MOSQUITTO" -c broker/mosquitto.conf > broker/log 2>&1 &
pids+=($!)
for _ in $(seq 100); do
    "$ISTHMUS" wan exec job.yaml b -- python3 -c \
        "import socket; socket.create_connection(('10.213.0.1', 8883), timeout=1)" \
        2>/dev/null && break
    sleep 0.2
done

say "sites: isthmus site on each host"
declare -A site_pid
for site in a b c; do
    "$ISTHMUS" wan exec job.yaml "$site" -- \
        "$ISTHMUS" site job.yaml --site "$site" --out "sites/$site" > "$site.log" 2>&1 &
    site_pid[$site]=$!
    pids+=($!)
done
failed=0
for site in a b c; do
    if wait "${site_pid[$site]}"; then
        say "site $site finished"
    else
        say "site $site failed (exit $?); the end of $OUT/$site.log:"
        tail -n 20 "$site.log" >&2
        failed=1
    fi
done
[[ $failed == 0 ]] || exit 1

digests=()
for site in a b c; do
    digest=$(python3 -c \
        "import json; print(json.load(open('sites/$site/sites/$site/result.json'))['param_sha256'])")
    say "site $site: param_sha256 $digest"
    digests+=("$digest")
done
if [[ $(printf '%s\n' "${digests[@]}" | sort -u | wc -l) != 1 ]]; then
    say "the sites disagree on the model"
    exit 1
fi
say "every site holds the same model; files in $OUT"
