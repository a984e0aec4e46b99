#!/usr/bin/env bash
# Makes podman ready to build and run Isthmus's images on this machine, and a
# base image to build them from when no registry can be reached:
#
#   bash scripts/containers.sh            # packages, podman's settings, the base image
#   bash scripts/containers.sh --check    # exit 0 if ready, else say what is missing
#
# What it takes, and why (measured on Debian 12, root, no registry reachable):
# - podman, buildah, runc, mmdebstrap from Debian (installed where root and apt are);
# - runc, not crun: crun 1.8 refuses a hybrid cgroup v1+v2 layout;
# - explicit ulimits: podman asks for 1048576 open files and processes, which
#   root without CAP_SYS_RESOURCE cannot set;
# - a base image made here with mmdebstrap (Debian bookworm, its Python 3.11)
#   carrying the host's extra CA certificates (a TLS-intercepting proxy's), so
#   pip inside a build trusts what the host trusts.
# The settings go to $ISTHMUS_CONTAINERS/containers.conf (default
# .containers/ in the repository); export CONTAINERS_CONF to that file in later
# shells. The base is $ISTHMUS_BASE_IMAGE (default localhost/isthmus-base:bookworm).
set -euo pipefail
cd "$(dirname "$0")/.."

DIR=${ISTHMUS_CONTAINERS:-$PWD/.containers}
BASE=${ISTHMUS_BASE_IMAGE:-localhost/isthmus-base:bookworm}
CONF="$DIR/containers.conf"
say() { echo "containers: $*"; }

check() {
  local missing=()
  for tool in podman buildah runc mmdebstrap; do
    command -v "$tool" >/dev/null 2>&1 || missing+=("$tool")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    say "not installed: ${missing[*]}; run: sudo bash scripts/containers.sh"
    return 1
  fi
  [ -f "$CONF" ] || { say "no $CONF; run: sudo bash scripts/containers.sh"; return 1; }
  if ! CONTAINERS_CONF="$CONF" timeout 60 podman info >/dev/null 2>&1; then
    say "podman info fails with $CONF; run: sudo bash scripts/containers.sh"
    return 1
  fi
  if ! CONTAINERS_CONF="$CONF" podman image exists "$BASE"; then
    say "no base image $BASE; run: sudo bash scripts/containers.sh"
    return 1
  fi
  return 0
}

if [ "${1:-}" = --check ]; then
  check
  exit $?
fi

if [ "$(id -u)" != 0 ]; then
  say "needs root (packages, rootful podman storage); run: sudo bash scripts/containers.sh"
  exit 2
fi

missing=()
for tool in podman buildah runc mmdebstrap; do
  command -v "$tool" >/dev/null 2>&1 || missing+=("$tool")
done
if [ ${#missing[@]} -gt 0 ]; then
  command -v apt-get >/dev/null 2>&1 || { say "no apt-get to install ${missing[*]}"; exit 2; }
  say "installing podman buildah runc mmdebstrap (Debian)"
  apt-get update -qq
  # With their recommended packages (netavark and aardvark-dns: networks whose
  # containers reach each other by name; iptables): the set seen to work.
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
    podman buildah runc mmdebstrap uidmap slirp4netns fuse-overlayfs >/dev/null
fi

mkdir -p "$DIR"
nofile=$(ulimit -Hn)
nproc=$(ulimit -Hu)
pidmax=$(cat /proc/sys/kernel/pid_max)
if [ "$nproc" = unlimited ] || [ "$nproc" -gt "$pidmax" ]; then nproc=$pidmax; fi
if [ "$nofile" = unlimited ]; then nofile=1048576; fi
cat > "$CONF" <<EOF
# Written by scripts/containers.sh: podman and buildah read it through CONTAINERS_CONF.
[containers]
default_ulimits = ["nofile=$nofile:$nofile", "nproc=$nproc:$nproc"]
[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
EOF
export CONTAINERS_CONF="$CONF"

if ! podman image exists "$BASE"; then
  say "making the base image $BASE with mmdebstrap (Debian bookworm, Python 3.11)"
  rootfs="$DIR/rootfs.tar"
  mmdebstrap --quiet --variant=minbase \
    --include=python3,python3-venv,python3-pip,ca-certificates \
    --dpkgopt='path-exclude=/usr/share/doc/*' \
    --dpkgopt='path-include=/usr/share/doc/*/copyright' \
    --dpkgopt='path-exclude=/usr/share/man/*' \
    --dpkgopt='path-exclude=/usr/share/locale/*' \
    --customize-hook='cp /usr/local/share/ca-certificates/*.crt "$1/usr/local/share/ca-certificates/" 2>/dev/null || true' \
    --customize-hook='chroot "$1" update-ca-certificates >/dev/null' \
    bookworm "$rootfs"
  podman import \
    --change 'CMD ["/bin/bash"]' \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' \
    --change 'ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt' \
    --change 'ENV SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt' \
    --change 'ENV REQUESTS_CA_BUNDLE=/etc/ssl/certs/ca-certificates.crt' \
    --quiet "$rootfs" "$BASE" >/dev/null
  rm -f "$rootfs"
fi
check
say "ready: export CONTAINERS_CONF=$CONF  (base image $BASE)"
