"""The baseline the collective engine is measured against: a Gloo all-reduce across hosts.

Run one process per emulated host (``isthmus wan exec JOB SITE -- python -m
isthmus.deploy.bench.gloo_baseline ...``); every rank prints the seconds of each
all-reduce and its start and end on the wall clock as JSON. ``isthmus bench
allreduce --vs-gloo`` drives it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
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
    seconds, spans = [], []
    for _ in range(args.repeats):
        dist.barrier()
        start, started_at = time.perf_counter(), time.time()
        dist.all_reduce(tensor)
        seconds.append(time.perf_counter() - start)
        spans.append((started_at, time.time()))  # the hosts share this machine's clock
    # Ones summed over `world` ranks, `repeats` times in place: world ** repeats.
    correct = bool(torch.all(tensor == float(args.world**args.repeats)))
    report = {"seconds": seconds, "spans": spans, "bytes": tensor.numel() * 4, "ok": correct}
    print(json.dumps(report))
    dist.destroy_process_group()
    return 0


def time_on_hosts(
    job: Path, state: dict[str, Any], sites: list[str], *, size_mib: float, repeats: int
) -> dict[str, Any]:
    """Run one rank in each of ``sites``' emulated hosts (``isthmus wan exec``) and
    return the report: ``seconds`` of each all-reduce, from the last rank's start to
    the last rank's end (as Isthmus's rounds are timed), ``bytes``, ``ok``."""
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
    outs = [procs[0].communicate(timeout=1800)[0]]
    outs += [proc.communicate(timeout=120)[0] for proc in procs[1:]]
    for proc in procs:
        if proc.returncode != 0:
            raise RuntimeError(f"the Gloo baseline failed (exit {proc.returncode})")
    reports = [json.loads(out.strip().splitlines()[-1]) for out in outs]
    seconds = round_seconds([r["spans"] for r in reports])  # as Isthmus's rounds
    return {**reports[0], "seconds": seconds, "ok": all(r["ok"] for r in reports)}


def round_seconds(spans: Sequence[Sequence[Sequence[float]]]) -> list[float]:
    """Each round's time from every process's ``(start, end)`` wall-clock spans (one
    list per process, a span per round): from the last start to the last end. The
    processes share one machine's clock. On uneven links no barrier releases them
    at once, and one released early only gains; timed from each one's own start, a
    one-trip round took one or two of its trips by the phase the barrier left."""
    return [max(s[i][1] for s in spans) - max(s[i][0] for s in spans) for i in range(len(spans[0]))]


if __name__ == "__main__":
    raise SystemExit(main())
