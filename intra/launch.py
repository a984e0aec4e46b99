"""Isthmus's own launcher for a site's ranks: torchrun's environment, without torchrun.

Each rank is a separate process with ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` set as torchrun sets
them, so the same program runs under either. Used to run every site of an
emulated job on one machine; on a cluster, torchrun (or Slurm) does this.
"""

from __future__ import annotations

import os
import random
import socket
import subprocess
from collections.abc import Mapping, Sequence

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


def rank_environment(
    rank: int, world_size: int, master_port: int, master_addr: str = "127.0.0.1"
) -> dict[str, str]:
    """The variables torchrun sets for one rank of a single-node site."""
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
    }


def launch_ranks(
    command: Sequence[str],
    ranks: int,
    *,
    env: Mapping[str, str] | None = None,
    **popen: object,
) -> list[subprocess.Popen]:
    """Start ``command`` once per rank; the caller waits for them."""
    master_port = free_port()
    base = {**os.environ, **(env or {})}
    return [
        subprocess.Popen(
            list(command),
            env={**base, **rank_environment(rank, ranks, master_port)},
            **popen,  # type: ignore[arg-type]
        )
        for rank in range(ranks)
    ]
