"""Emulated hosts for the packet-level backend: one network namespace and one TUN device per site.

Each site of a topology becomes a host with its own network stack (its own
addresses, routes, sockets and TCP), reachable from the other hosts only
through the router (:mod:`isthmus.sim.router`), which holds every TUN file
descriptor. A TUN device that is not persistent disappears when the last
descriptor closes, so the router owns the devices' lifetime; the namespaces
are removed by :meth:`Hosts.remove`, or by the next ``isthmus wan up --hosts``
when a router was killed before it could clean up.

Needs root (CAP_NET_ADMIN) and iproute2's ``ip``.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import ipaddress
import os
import shutil
import struct
import subprocess
from dataclasses import dataclass
from pathlib import Path

from isthmus.job.exposure import EMULATED_HOSTS_SUBNET

TUNSETIFF = 0x400454CA
TUNSETOFFLOAD = 0x400454D0
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000
IFF_VNET_HDR = 0x4000
# What the router accepts from the hosts' stacks: partial checksums and TCP
# segmentation offload (IPv4, with ECN), so TCP hands it ~64 KB super-packets.
TUN_F_CSUM = 0x01
TUN_F_TSO4 = 0x02
TUN_F_TSO_ECN = 0x08

NETNS_PREFIX = "isthmus-"
NETNS_DIR = Path("/run/netns")
# Addresses inside the namespaces: a private /16 of their own, invisible to the
# root namespace and to the real network (which is why a job dialled there needs
# no TLS: isthmus.job.exposure).
DEFAULT_SUBNET = EMULATED_HOSTS_SUBNET
# An owner file beside each namespace says which router made it.
OWNER_DIR = Path("/run/isthmus")
TCP_BUFFER_MAX = 32 * 2**20
"""The hosts' TCP buffer limits by default: 1 Gbit/s x 250 ms, a long link at full rate."""
MIN_TCP_RMEM_MAX = 64 * 1024
"""A smaller receive buffer would hold back even a LAN."""


class HostsUnavailable(RuntimeError):
    """This machine cannot make emulated hosts (no root, no netns, no TUN); says why."""


def check_support() -> None:
    """Raise :class:`HostsUnavailable` with a one-line reason if hosts cannot be made here."""
    if os.geteuid() != 0:
        raise HostsUnavailable("emulated hosts need root (network namespaces and TUN devices)")
    if shutil.which("ip") is None:
        raise HostsUnavailable(
            "emulated hosts need iproute2's 'ip' command (apt-get install iproute2)"
        )
    if not os.path.exists("/dev/net/tun"):
        raise HostsUnavailable("emulated hosts need /dev/net/tun (the tun kernel module)")
    probe = f"{NETNS_PREFIX}probe-{os.getpid()}"
    result = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if result.returncode != 0:
        raise HostsUnavailable(f"cannot create network namespaces: {result.stderr.strip()}")
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)


def _ip(*args: str) -> None:
    result = subprocess.run(["ip", *args], capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"'ip {' '.join(args)}' failed: {result.stderr.strip()}")


@dataclass(frozen=True)
class Host:
    """One emulated host: a site's namespace, its address and the router's end of its TUN."""

    site: str
    netns: str
    device: str
    address: str
    fd: int


def netns_name(job: str, site: str) -> str:
    return f"{NETNS_PREFIX}{job}-{site}"


def _device_name(job: str, index: int) -> str:
    # Interface names are at most 15 bytes: a short hash of the job keeps
    # devices of two jobs apart.
    digest = hashlib.sha1(job.encode()).hexdigest()[:6]
    return f"ist{digest}-{index}"


def _open_tun(name: str) -> int:
    """A TUN device whose reads and writes carry a virtio-net header (see sim/gso.py)."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        flags = IFF_TUN | IFF_NO_PI | IFF_VNET_HDR
        fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), flags))
        fcntl.ioctl(fd, TUNSETOFFLOAD, TUN_F_CSUM | TUN_F_TSO4 | TUN_F_TSO_ECN)
    except OSError:
        os.close(fd)
        raise
    return fd


class Hosts:
    """Creates the hosts of a job's sites; :meth:`remove` undoes everything it made."""

    def __init__(
        self,
        job: str,
        sites: list[str],
        *,
        subnet: str = DEFAULT_SUBNET,
        tcp_rmem_max: int = TCP_BUFFER_MAX,
    ) -> None:
        """``tcp_rmem_max``: the hosts' largest TCP receive buffer, which caps how much a
        sender may have in flight to them (see :func:`tune_namespace`)."""
        if tcp_rmem_max < MIN_TCP_RMEM_MAX:
            raise ValueError(
                f"tcp_rmem_max must be >= {MIN_TCP_RMEM_MAX} bytes, got {tcp_rmem_max}"
            )
        self.job = job
        self.sites = list(sites)
        self.tcp_rmem_max = tcp_rmem_max
        network = ipaddress.ip_network(subnet)
        if network.num_addresses < len(sites) + 2:
            raise ValueError(f"subnet {subnet} is too small for {len(sites)} hosts")
        self.prefix = network.prefixlen
        self._addresses = [str(network.network_address + i + 1) for i in range(len(sites))]
        self.hosts: dict[str, Host] = {}

    def create(self) -> dict[str, Host]:
        """Make every host. On failure, removes what it made and re-raises."""
        remove_leftovers(self.job)
        try:
            for index, site in enumerate(self.sites):
                self.hosts[site] = self._create_one(index, site)
        except BaseException:
            self.remove()
            raise
        return self.hosts

    def _create_one(self, index: int, site: str) -> Host:
        netns = netns_name(self.job, site)
        device = _device_name(self.job, index)
        address = self._addresses[index]
        _ip("netns", "add", netns)
        OWNER_DIR.mkdir(parents=True, exist_ok=True)
        (OWNER_DIR / netns).write_text(str(os.getpid()))
        fd = _open_tun(device)
        try:
            _ip("link", "set", "dev", device, "netns", netns)
            _ip("-n", netns, "addr", "add", f"{address}/{self.prefix}", "dev", device)
            _ip("-n", netns, "link", "set", "lo", "up")
            _ip("-n", netns, "link", "set", device, "up")
        except BaseException:
            os.close(fd)
            raise
        tune_namespace(netns, tcp_rmem_max=self.tcp_rmem_max)
        return Host(site=site, netns=netns, device=device, address=address, fd=fd)

    def remove(self) -> None:
        """Close the TUN descriptors (the devices vanish) and delete the namespaces."""
        for host in self.hosts.values():
            with contextlib.suppress(OSError):
                os.close(host.fd)
        for site in self.sites:
            _delete_netns(netns_name(self.job, site))
        self.hosts.clear()


def tune_namespace(netns: str, *, tcp_rmem_max: int = TCP_BUFFER_MAX) -> None:
    """Settings that are per namespace: TCP buffer autotuning limits large enough for
    long fat links (32 MiB, about 1 Gbit/s x 250 ms). net.core.rmem_max and wmem_max
    are global: raise them in the root namespace for explicit SO_RCVBUF/SO_SNDBUF.

    ``tcp_rmem_max`` below that caps the window a host advertises, so a sender never
    has more in flight to it than about that many bytes: sized to twice a link's
    bandwidth-delay product, a queue shallower than one BDP no longer overflows
    (BBR otherwise keeps up to 2 BDP in flight; README, "real TCP")."""
    for key, value in (
        ("net.ipv4.tcp_rmem", f"4096 131072 {tcp_rmem_max}"),
        ("net.ipv4.tcp_wmem", f"4096 16384 {TCP_BUFFER_MAX}"),
        ("net.ipv4.tcp_no_metrics_save", "1"),
        # Hosts talk IPv4 only; IPv6 would only add neighbour discovery noise.
        ("net.ipv6.conf.all.disable_ipv6", "1"),
    ):
        subprocess.run(
            ["ip", "netns", "exec", netns, "sysctl", "-q", "-w", f"{key}={value}"],
            capture_output=True,
        )


def _delete_netns(netns: str) -> None:
    if (NETNS_DIR / netns).exists():
        subprocess.run(["ip", "netns", "del", netns], capture_output=True)
    with contextlib.suppress(FileNotFoundError):
        (OWNER_DIR / netns).unlink()


def remove_leftovers(job: str) -> list[str]:
    """Delete this job's namespaces whose router is gone (killed before cleaning up).

    A namespace whose owner is still alive is refused: two routers for one job
    would fight over the same names."""
    removed = []
    prefix = f"{NETNS_PREFIX}{job}-"
    if not NETNS_DIR.exists():
        return removed
    for entry in NETNS_DIR.iterdir():
        if not entry.name.startswith(prefix):
            continue
        owner = OWNER_DIR / entry.name
        pid = int(owner.read_text()) if owner.exists() else None
        if pid is not None and pid != os.getpid() and _alive(pid):
            raise RuntimeError(
                f"namespace {entry.name} belongs to a running router (pid {pid}); "
                "stop that 'isthmus wan up --hosts' first"
            )
        _delete_netns(entry.name)
        removed.append(entry.name)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
