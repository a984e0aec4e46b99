"""Isthmus's own launcher for a site's ranks: torchrun's environment, without torchrun.

Each rank is a separate process with ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` set as torchrun sets
them, so the same program runs under either. Used to run every site of an
emulated job on one machine; on a cluster, torchrun (or Slurm) does this.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from isthmus.job.ports import free_port


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
    spawn: Callable[..., Any] = subprocess.Popen,
    **popen: object,
) -> list[Any]:
    """Start ``command`` once per rank; the caller waits for them. ``spawn``: what
    starts a process, ``subprocess.Popen`` or one with its interface (such as
    ``warm_popen.popen``, which forks from a warm template)."""
    master_port = free_port()
    base = {**os.environ, **(env or {})}
    return [
        spawn(
            list(command),
            env={**base, **rank_environment(rank, ranks, master_port)},
            **popen,
        )
        for rank in range(ranks)
    ]
