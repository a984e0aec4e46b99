"""Where a rank computes: ``train.device`` resolved against what the process sees.

One process per GPU: a rank of a site computes on ``cuda:LOCAL_RANK`` (torchrun's
local rank, 0 for a one-rank site). ``auto`` takes the GPU when the rank sees one
and the CPU otherwise, so the same job file runs on a laptop and on a cluster.
Everything Isthmus allocates for a rank (the model, batches, the tensors of its
in-site collectives, the codecs' work) goes on this one device; the host holds
only what crosses the WAN and, with ``train.outer_state: host``, the outer state.

The refusals here run before a site starts anything, so a job that asks for a
GPU the machine does not have fails at once, naming the field and the fix, and
not at its first collective minutes later.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

from isthmus.job.settings import SettingError

if TYPE_CHECKING:
    import torch

# Device files a GPU driver creates: NVIDIA's control node, AMD's (ROCm, which
# torch also calls "cuda"). Without any of them no process can see a GPU.
_GPU_DRIVER_NODES = ("/dev/nvidiactl", "/dev/kfd")


def visible_gpus() -> int:
    """GPUs this process may use (``CUDA_VISIBLE_DEVICES`` applied).

    On a machine without a GPU driver the answer is 0 without importing torch:
    the launcher asks before it starts any rank, and torch's import costs
    seconds of CPU that a small machine's ranks would rather have."""
    if not any(Path(node).exists() for node in _GPU_DRIVER_NODES):
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def local_rank() -> int:
    """This rank's index on its machine (torchrun's ``LOCAL_RANK``; 0 alone)."""
    try:
        return int(os.environ.get("LOCAL_RANK", "0"))
    except ValueError:
        raise SettingError(
            "LOCAL_RANK", f"must be an integer, got {os.environ['LOCAL_RANK']!r}"
        ) from None


def wants_cuda(setting: str, gpus: int | None = None) -> bool:
    """Whether ``train.device`` puts the ranks on GPUs, given ``gpus`` visible ones."""
    gpus = visible_gpus() if gpus is None else gpus
    if setting == "cuda" and gpus == 0:
        raise SettingError(
            "device",
            "cuda, but this machine shows no GPU to this process (torch.cuda.is_available() "
            "is False; check CUDA_VISIBLE_DEVICES and the driver); use device: auto or cpu "
            "to train on the CPU",
        )
    return setting == "cuda" or (setting == "auto" and gpus > 0)


def compute_device(setting: str, rank_on_machine: int | None = None) -> torch.device:
    """The device this rank computes on, for ``train.device`` = ``setting``."""
    import torch

    if not wants_cuda(setting):
        return torch.device("cpu")
    index = local_rank() if rank_on_machine is None else rank_on_machine
    gpus = visible_gpus()
    if index >= gpus:
        raise SettingError(
            "device",
            f"local rank {index} has no GPU of its own: this machine shows {gpus} GPU(s); "
            f"start at most {gpus} rank(s) per machine (torchrun --nproc-per-node {gpus}, "
            "with --nnodes for more machines) or use device: cpu",
        )
    return torch.device("cuda", index)


def check_site_fits(site: str, ranks_per_node: int, setting: str, gpus: int | None = None) -> None:
    """Refuse a site that would start more ranks on one machine than it has GPUs."""
    gpus = visible_gpus() if gpus is None else gpus
    if wants_cuda(setting, gpus) and ranks_per_node > gpus:
        nodes = -(-ranks_per_node // max(gpus, 1))
        raise SettingError(
            "device",
            f"site {site!r} starts {ranks_per_node} rank(s) on this machine, which shows "
            f"{gpus} GPU(s): one process per GPU; start it as torchrun --nnodes {nodes} "
            f"--nproc-per-node {gpus} (sites[].nodes: {nodes} in the job file), or use "
            "device: cpu",
        )


def emulated_gpu_map(sites: list[tuple[str, int]], setting: str, gpus: int | None = None) -> dict:
    """How ``isthmus run`` on one machine places the job's ranks on its GPUs.

    Each site's ranks take GPUs 0..ranks-1 (a site's ranks must not share one:
    NCCL refuses two ranks of one communicator on one device), and different
    sites share GPUs, as emulated sites share the machine's cores. Returns
    ``{site: [gpu of each local rank]}``, empty on the CPU; a site with more ranks
    than the machine has GPUs is refused with the fix."""
    gpus = visible_gpus() if gpus is None else gpus
    if not wants_cuda(setting, gpus):
        return {}
    placement = {}
    for name, ranks in sites:
        if ranks > gpus:
            raise SettingError(
                "device",
                f"site {name!r} has {ranks} ranks but this machine shows {gpus} GPU(s), and "
                "ranks of one site cannot share a GPU (NCCL); lower its ranks to "
                f"{gpus}, run it on more machines with isthmus site, or use device: cpu",
            )
        placement[name] = list(range(ranks))
    return placement


def describe_gpu_map(placement: dict) -> str:
    """One line for ``isthmus run``'s start: which GPUs each site's ranks use."""
    if not placement:
        return "device: cpu"
    shared = len({g for gpus in placement.values() for g in gpus}) < sum(
        len(g) for g in placement.values()
    )
    parts = [f"{site} -> cuda:{','.join(map(str, g))}" for site, g in placement.items()]
    return "device: " + "; ".join(parts) + (" (sites share GPUs, as emulation)" if shared else "")


def out_of_memory_message(exc: BaseException, site: str, rank: int) -> str:
    """One line for a rank that ran out of device memory: which rank, how much it
    asked for (torch's message says), what the device holds, and the settings that
    lower the need."""
    asked = re.search(r"[Tt]ried to allocate ([0-9.]+ [KMGT]?i?B)", str(exc))
    import torch

    held = ""
    if torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info()
        held = f"; the GPU has {free / 2**30:.1f} GiB free of {total / 2**30:.1f} GiB"
    return (
        f"site {site!r} rank {rank} ran out of device memory "
        f"(asked for {asked.group(1) if asked else 'more than was free'}{held}); lower "
        "train.batch_size, use train.precision: bf16, train.outer_state: host, or shard "
        "the model over more ranks (parallel.dp_shard)"
    )


__all__ = [
    "check_site_fits",
    "compute_device",
    "describe_gpu_map",
    "emulated_gpu_map",
    "local_rank",
    "out_of_memory_message",
    "visible_gpus",
    "wants_cuda",
]
