"""One site of ``isthmus bench allreduce``: a separate process, as a real site would be.

It listens where the emulator's state file says its rank listens, dials its
peers through the emulated links, runs ``--repeats`` all-reduces of a
deterministic tensor, each after a barrier (a one-value round), and writes, as
JSON, the seconds of each round and its start and end on the wall clock, the
data-plane bytes it sent, its error against a float64 reference and a digest of
its result (identical on every site, or the engine is wrong), the digest of
every round (the same tensor each time, so the same digest: a corrupted chunk
that was applied would change one), and what faults cost: chunks refused,
resent, streams broken.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import sys
import time
from pathlib import Path

import torch

from isthmus.inter.allocator import keep_freed_memory
from isthmus.inter.allreduce import CorruptPayloads, CrossSiteAllReduce, RoundError
from isthmus.inter.codecs import parse_codec
from isthmus.inter.peer import Identity
from isthmus.inter.transport import TransportSettings
from isthmus.job.addressing import load_state
from isthmus.job.file import load_job
from isthmus.sim.cost import LinkCost, job_costs, job_uplinks


def site_tensor(index: int, count: int) -> torch.Tensor:
    """The tensor site ``index`` contributes: reproducible anywhere from the index."""
    return torch.randn(count, generator=torch.Generator().manual_seed(1000 + index))


def reference(sites: int, count: int) -> torch.Tensor:
    return sum(site_tensor(i, count).double() for i in range(sites)) / sites


async def run(args: argparse.Namespace) -> dict[str, object]:
    state = load_state(args.state)
    names = sorted(state["sites"])
    me = args.site
    host, port = state["sites"][me]["listen"][0].rsplit(":", 1)
    peers = {site: addresses[0] for site, addresses in state["sites"][me]["dial"].items()}
    identity = Identity(job=state["job"], site=me, rank=0)
    # Every link as configured: the same on every site, so "auto" agrees everywhere.
    cost = LinkCost.of(bandwidth_mbit=args.bandwidth_mbit, rtt_ms=args.rtt_ms)
    links, regions, egress, uplinks = (lambda a, b: cost), None, None, None
    if args.job is not None:  # a job file's own links, regions and uplink caps
        job = load_job(args.job)
        costs, grouped = job_costs(job)
        assert costs is not None, "a bench job is emulated: it has links"
        links, regions = costs, job.region_of()
        egress = None if grouped is None else dict(grouped.egress_bytes_per_s)
        uplinks = job_uplinks(job)
    settings = TransportSettings(
        max_chunk_bytes=int(args.chunk_kib * 1024),
        stall_s=args.stall_s,
        connections_per_peer=args.connections,
    )
    # A fault for the fault benchmark, seeded by site, rank and lane.
    corrupter = (
        CorruptPayloads(args.corrupt_payloads, seed=f"{me}/0/0") if args.corrupt_payloads else None
    )
    engine = CrossSiteAllReduce(
        identity,
        peers,
        codec=parse_codec(args.codec),
        settings=settings,
        deadline_s=args.deadline_s,
        link_costs=links,
        regions=regions,
        region_egress_bytes_per_s=egress,
        uplink_bytes_per_s=uplinks,
        chunk_filter=corrupter,
    )
    await engine.start(host, int(port))
    count = int(args.size_mib * 2**20 / 4)
    tensor = site_tensor(names.index(me), count)
    try:
        await engine.connect()
        weights = {s: 1.0 for s in names}
        seconds, sent, digests, phases = [], [], [], []
        spans: list[tuple[float, float]] = []  # wall clock: the sites share this machine's
        out = tensor
        barrier = torch.zeros(1)
        for round in range(args.repeats + 1):  # round 0 warms up connections and windows
            # The sites start each round together, as near as a barrier allows (as
            # Gloo's baseline is timed, after dist.barrier()): a one-value round
            # first. Otherwise a site that finished the last round early would
            # start this one early, and wait, or send, while the others finish.
            # A round is timed from the last site's start (gloo_baseline.round_seconds).
            await engine.allreduce(barrier, round=2 * round, participants=names, weights=weights)
            start, started_at = time.perf_counter(), time.time()
            out = await engine.allreduce(
                tensor,
                round=2 * round + 1,
                participants=names,
                weights=weights,
                algorithm=args.algorithm,
            )
            if round:
                seconds.append(time.perf_counter() - start)
                spans.append((started_at, time.time()))
                assert engine.last is not None
                sent.append(engine.last.bytes_sent)
                phases.append(engine.last.phases)
            if args.round_digests:  # off for timing: hashing 64 MiB takes ~0.1 s of CPU
                digests.append(_digest(out))
            if args.idle_s and round < args.repeats:
                # What compute between rounds does to the links: they go quiet.
                await asyncio.sleep(args.idle_s)
    finally:
        await engine.close()
    error = float((out.double() - reference(len(names), count)).abs().max()) if count else 0.0
    return {
        "site": me,
        "algorithm": engine.last_algorithm,
        "seconds": seconds,
        "spans": spans,
        "bytes_sent": sent,
        "phases": phases,
        "max_abs_error": error,
        "digest": _digest(out),
        "round_digests": digests,
        "refusals": dict(engine.server.servicer.refusals),
        "resent_chunks": engine.resent_chunks,
        "broken_streams": engine.broken_streams,
        "times_refused": dict(engine.times_refused),
        "corrupted_on_purpose": corrupter.corrupted if corrupter else 0,
    }


def _digest(values: torch.Tensor) -> str:
    return hashlib.sha256(values.numpy().tobytes()).hexdigest()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m isthmus.deploy.bench.allreduce_worker")
    parser.add_argument("--state", required=True)
    parser.add_argument("--site", required=True)
    parser.add_argument("--size-mib", type=float, required=True)
    parser.add_argument("--codec", default="none")
    parser.add_argument(
        "--algorithm", choices=("direct", "gather", "ring", "two_level", "auto"), default="direct"
    )
    parser.add_argument("--job", help="the links and regions for auto and two_level")
    parser.add_argument("--rtt-ms", type=float, default=0.0, help="the links, for auto")
    parser.add_argument("--bandwidth-mbit", type=float, default=1000.0, help="the links, for auto")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--deadline-s", type=float, default=300.0)
    parser.add_argument("--chunk-kib", type=float, default=4096, help="largest chunk")
    parser.add_argument(
        "--round-digests", action="store_true", help="a digest of every round's result"
    )
    parser.add_argument("--stall-s", type=float, default=30.0, help="see TransportSettings")
    parser.add_argument(
        "--connections", type=int, default=1, help="TCP connections to each peer rank"
    )
    parser.add_argument(
        "--idle-s", type=float, default=0.0, help="pause after each round, as compute would"
    )
    parser.add_argument(
        "--corrupt-payloads",
        type=float,
        default=0.0,
        metavar="FRACTION",
        help="flip a bit in this fraction of outgoing chunks after their checksum (a fault)",
    )
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    keep_freed_memory()  # this process is a data path: reuse chunk buffers (see allocator)
    try:
        result = asyncio.run(run(args))
    except RoundError as exc:
        # Said once, plainly, and kept for the launcher to report (bench_allreduce).
        Path(args.out).write_text(json.dumps({"error": str(exc)}))
        print(f"allreduce_worker: site {args.site}: {exc}", file=sys.stderr)
        return 1
    Path(args.out).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
