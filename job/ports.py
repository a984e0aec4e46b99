"""Picking ports to listen on: the one helper every launcher, benchmark and test uses.

Ports are picked below Linux's ephemeral range, so an outgoing connection cannot
take a port between the moment it is picked and the moment a slow process (torch
takes seconds to import) listens on it.
"""

from __future__ import annotations

import random
import socket

RDZV_PORT = 29400
"""torchrun's default c10d rendezvous port, on a multi-node site's first node."""

LISTEN_PORTS = (20000, 32767)
"""Where listening ports are picked: below Linux's default ephemeral range (32768-60999).
A port the OS hands out for binding to 0 comes from that range, so between picking it
and a slow process (torch takes seconds to import) listening on it, an outgoing
connection may take it as its source port: seen in CI as "address already in use"."""


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on ``host`` now, outside the range outgoing connections use."""
    return free_ports(host, 1)[0]


def free_ports(host: str, count: int) -> list[int]:
    """``count`` distinct ports free on ``host`` now (see :data:`LISTEN_PORTS`)."""
    low, high = _listen_range()
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    picked: list[int] = []
    for candidate in random.sample(range(low, high + 1), k=min(2000, high - low + 1)):
        with socket.socket(family) as sock:
            try:
                sock.bind((host, candidate))
            except OSError:
                continue
        picked.append(candidate)
        if len(picked) == count:
            return picked
    # Nothing free below the ephemeral range: let the OS choose.
    sockets = [socket.socket(family) for _ in range(count - len(picked))]
    try:
        for sock in sockets:
            sock.bind((host, 0))
        return picked + [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def _listen_range() -> tuple[int, int]:
    """:data:`LISTEN_PORTS`, ending below this machine's ephemeral range."""
    low, high = LISTEN_PORTS
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            ephemeral_low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return low, high
    if ephemeral_low - 1 > low + 1000:
        high = ephemeral_low - 1
    return low, high


def free_port_blocks(host: str, sizes: list[int]) -> list[int]:
    """A base port per entry of ``sizes`` such that ``base .. base + size - 1`` are
    all free now and no two blocks overlap: a site's rank r listens on base + r."""
    bases: list[int] = []
    taken: set[int] = set()
    for size in sizes:
        for _ in range(100):
            base = free_port(host)
            block = set(range(base, base + size))
            if base + size <= 65536 and not block & taken and _all_free(host, block):
                bases.append(base)
                taken |= block
                break
        else:
            raise RuntimeError(f"no block of {size} free ports found on {host}")
    return bases


def _all_free(host: str, ports: set[int]) -> bool:
    for port in ports:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                return False
    return True
