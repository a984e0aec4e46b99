"""The baseline the collective engine is measured against: a Gloo all-reduce across hosts.

Run one process per emulated host (``isthmus wan exec JOB SITE -- python -m
isthmus.deploy.bench.gloo_baseline ...``); rank 0 prints the seconds of each
all-reduce as JSON. ``isthmus bench wan --hosts`` drives it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m isthmus.deploy.bench.gloo_baseline")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--master", required=True, metavar="HOST:PORT", help="rank 0's address")
    parser.add_argument("--ifname", help="network interface Gloo should use (GLOO_SOCKET_IFNAME)")
    parser.add_argument("--size-mib", type=float, default=64.0)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    if args.ifname:
        os.environ["GLOO_SOCKET_IFNAME"] = args.ifname
    # Hosts in namespaces have no name for their address: c10d would warn about
    # it on every connection.
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

    import torch
    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{args.master}",
        rank=args.rank,
        world_size=args.world,
        timeout=datetime.timedelta(seconds=300),
    )
    tensor = torch.ones(int(args.size_mib * 2**20 / 4), dtype=torch.float32)
    dist.all_reduce(torch.ones(16))  # connections up before timing
    seconds = []
    for _ in range(args.repeats):
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(tensor)
        seconds.append(time.perf_counter() - start)
    # Ones summed over `world` ranks, `repeats` times in place: world ** repeats.
    correct = bool(torch.all(tensor == float(args.world**args.repeats)))
    if args.rank == 0:
        print(json.dumps({"seconds": seconds, "bytes": tensor.numel() * 4, "ok": correct}))
    dist.destroy_process_group()
    return 0


def time_on_hosts(
    job: Path, state: dict[str, Any], sites: list[str], *, size_mib: float, repeats: int
) -> dict[str, Any]:
    """Run one rank in each of ``sites``' emulated hosts (``isthmus wan exec``) and
    return rank 0's report: ``seconds`` of each all-reduce, ``bytes``, ``ok``."""
    master = "{}:29500".format(state["sites"][sites[0]]["address"])
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "isthmus",
                "wan",
                "exec",
                str(job),
                site,
                "--",
                sys.executable,
                "-m",
                "isthmus.deploy.bench.gloo_baseline",
                "--rank",
                str(rank),
                "--world",
                str(len(sites)),
                "--master",
                master,
                "--ifname",
                state["sites"][site]["device"],
                "--size-mib",
                str(size_mib),
                "--repeats",
                str(repeats),
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        for rank, site in enumerate(sites)
    ]
    out, _ = procs[0].communicate(timeout=1800)
    for proc in procs[1:]:
        proc.wait(timeout=120)
    if procs[0].returncode != 0:
        raise RuntimeError(f"the Gloo baseline failed (exit {procs[0].returncode})")
    return json.loads(out.strip().splitlines()[-1])


if __name__ == "__main__":
    raise SystemExit(main())
