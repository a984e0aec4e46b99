"""A site's torch.distributed process group and its data-parallel subgroups.

A site is a torch.distributed job. Launched by torchrun (or by
:mod:`isthmus.intra.launch`, which sets the same environment: ``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), its ranks form one process
group: NCCL on GPUs, Gloo on CPUs. A one-rank site needs no launcher and no
process group: it is a plain Python process.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from isthmus.job.layout import Layout


class SiteError(RuntimeError):
    """The site cannot start; the message names the setting and the fix."""


def launcher_rank() -> tuple[int, int]:
    """(rank, world size) from the launcher's environment; (0, 1) without one."""
    try:
        return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        raise SiteError(
            f"RANK={os.environ.get('RANK')!r} / WORLD_SIZE={os.environ.get('WORLD_SIZE')!r} "
            "are not integers; launch with torchrun or isthmus's launcher"
        ) from None


def init_site_group(
    site: str, ranks: int, backend: str | None = None, timeout_s: float | None = None
) -> int:
    """Join the site's process group (when it has more than one rank); return this rank.
    ``timeout_s``: how long its collectives wait for a rank (torch's default: None)."""
    rank, world = launcher_rank()
    if world != ranks:
        raise SiteError(
            f"site {site!r} has ranks: {ranks} in the job file, but the launcher started "
            f"{world} process(es); launch it with --nproc-per-node {ranks}"
        )
    if world > 1 and not dist.is_initialized():
        if torch.cuda.is_available():
            # One GPU per local rank, chosen before NCCL binds the communicator to one.
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(
            backend or ("nccl" if torch.cuda.is_available() else "gloo"),
            timeout=None if timeout_s is None else timedelta(seconds=timeout_s),
        )
    return rank


def dp_group(layout: Layout, rank: int, timeout_s: float | None = None) -> dist.ProcessGroup | None:
    """This rank's data-parallel group (None when it has no data-parallel peers).
    Every rank creates every group, in the same order (torch.distributed requires
    it), and keeps its own. ``timeout_s``: groups of their own with this timeout,
    instead of the site group's."""
    if layout.dp == 1:
        return None
    if layout.dp == layout.size and timeout_s is None:
        return dist.group.WORLD
    timeout = None if timeout_s is None else timedelta(seconds=timeout_s)
    mine = None
    for pp in range(layout.pp):
        for tp in range(layout.tp):
            ranks = [layout.rank_of(pp=pp, dp=d, tp=tp) for d in range(layout.dp)]
            group = dist.new_group(ranks, timeout=timeout)
            if rank in ranks:
                mine = group
    return mine


def waiting_group(ranks: int, timeout_s: float) -> dist.ProcessGroup:
    """Every rank of the site, for the collectives that wait while some ranks wait on
    other sites or the membership: their timeout must outlast those waits, which the
    site group's (a hung rank) must not."""
    return dist.new_group(list(range(ranks)), timeout=timedelta(seconds=timeout_s))
