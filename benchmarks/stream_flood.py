"""A site under a stream flood: its memory and round time, against the same rounds undisturbed.

``python benchmarks/stream_flood.py [--streams 1000] [--rounds 30] [--out F.json]``

Two sites, ``a`` and ``b``, each its own process, run all-reduce rounds of
``--mb`` MB over mutual TLS (the engine alone, back to back). A third process
holds site ``c``'s valid certificate (the strongest flooder: it gets past the
TLS handshake and every identity check) and, from round ``rounds / 3`` on,
opens ``--streams`` Exchange streams to site a's rank at once over ten
connections, each sending one chunk of a round that is over and then holding
the stream open, for ``--flood-s`` seconds; then it lets go and opens them
again, until round ``2 rounds / 3``. The flooder runs at the lowest CPU
priority: on a real network its CPU is its own machine's, here it shares the
sites' cores.

Reported: site a's round times (median of the rounds before the flood, under
it, and after), their ratio, site a's resident memory before the flood and its
peak under it (``VmRSS`` sampled every round and ``VmHWM``), how many streams
site a cut off (``TOO_MANY_STREAMS``) and dropped (``STALE_ROUND``), and
whether every round's result was identical on both sites.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc
import torch

from isthmus.deploy.render.certs import make_certs
from isthmus.inter.allocator import keep_freed_memory
from isthmus.inter.allreduce import CrossSiteAllReduce
from isthmus.inter.chunks import encode_chunks
from isthmus.inter.codecs import parse_codec
from isthmus.inter.peer import META_JOB, META_RANK, META_SITE, Identity
from isthmus.inter.tls import SiteTls
from isthmus.inter.transport import TransportSettings
from isthmus.proto import wire_pb2_grpc

JOB = "flooded"
SITES = ("a", "b", "c")


def _memory_kib() -> tuple[int, int]:
    """(VmRSS, VmHWM) of this process, in KiB."""
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        fields[key] = value
    return int(fields["VmRSS"].split()[0]), int(fields["VmHWM"].split()[0])


def _tls(certs: Path, site: str) -> TransportSettings:
    files = (certs / "ca.crt", certs / f"{site}.crt", certs / f"{site}.key")
    return TransportSettings(tls=SiteTls.load(JOB, site, *files))


# -- a site ------------------------------------------------------------------------------
async def _site(args: argparse.Namespace) -> dict[str, Any]:
    keep_freed_memory()
    torch.set_num_threads(1)
    me = args.site
    other = "b" if me == "a" else "a"
    identity = Identity(job=JOB, site=me, rank=0, layout_fingerprint="L")
    member = CrossSiteAllReduce(
        identity,
        {other: f"127.0.0.1:{args.ports[other]}"},
        settings=_tls(args.certs, me),
        deadline_s=120,
    )
    await member.start("127.0.0.1", args.ports[me])
    member.server.servicer.sites = set(SITES)
    await member.connect()
    values = torch.randn(args.mb * 262144, generator=torch.Generator().manual_seed(ord(me)))
    flood_on = args.work / "flood-on"
    rounds = []
    weights = {"a": 1.0, "b": 1.0}
    for r in range(args.rounds):
        flooded = flood_on.exists()
        started = time.perf_counter()
        out = await member.allreduce(values, round=r, participants=["a", "b"], weights=weights)
        seconds = time.perf_counter() - started
        rss, _ = _memory_kib()
        digest = hashlib.sha256(out.numpy().tobytes()).hexdigest()[:16]
        rounds.append({"round": r, "seconds": seconds, "flooded": flooded or flood_on.exists(),
                       "rss_kib": rss, "digest": digest})  # fmt: skip
        (args.work / f"{me}.round").write_text(str(r + 1))
    _, peak = _memory_kib()
    refusals = dict(member.server.servicer.refusals)
    await member.close()
    return {"site": me, "rounds": rounds, "vm_hwm_kib": peak, "refusals": refusals}


# -- the flooder -------------------------------------------------------------------------
async def _flood(args: argparse.Namespace) -> dict[str, Any]:
    settings = _tls(args.certs, "c")
    assert settings.tls is not None
    work = args.work
    address = f"127.0.0.1:{args.ports['a']}"
    metadata = ((META_JOB, JOB), (META_SITE, "c"), (META_RANK, "0"))
    [stale] = encode_chunks(
        parse_codec("none"), torch.zeros(256), round=0, shard=0, max_chunk_bytes=1 << 20
    )

    async def one(stub: Any, hold_s: float) -> str:
        async def requests():
            yield stale
            await asyncio.sleep(hold_s)

        try:
            async for _ in stub.Exchange(requests(), metadata=metadata, timeout=hold_s + 30):
                pass
            return "held"
        except grpc.aio.AioRpcError as exc:
            return exc.code().name

    def rounds_done() -> int:
        try:
            return int((work / "a.round").read_text())
        except (OSError, ValueError):
            return 0

    while rounds_done() < args.rounds // 3:
        await asyncio.sleep(0.05)
    (work / "flood-on").touch()
    waves, outcomes = 0, {}
    while rounds_done() < 2 * args.rounds // 3:
        channels = [
            grpc.aio.secure_channel(
                address,
                settings.tls.channel_credentials(),
                options=[*settings.tls.channel_options("a"), ("grpc.use_local_subchannel_pool", 1)],
            )
            for _ in range(10)
        ]
        stubs = [wire_pb2_grpc.PeerServiceStub(c) for c in channels]
        ended = await asyncio.gather(
            *[one(stubs[i % 10], args.flood_s) for i in range(args.streams)]
        )
        for outcome in ended:
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
        for channel in channels:
            await channel.close()
        waves += 1
    (work / "flood-on").unlink()
    return {"waves": waves, "streams_per_wave": args.streams, "outcomes": outcomes}


# -- the driver --------------------------------------------------------------------------
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=90)
    parser.add_argument("--mb", type=int, default=16, help="MB of float32 values per round")
    parser.add_argument("--flood-s", type=float, default=1.0, help="how long each wave holds")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--role", choices=("site", "flood"), help=argparse.SUPPRESS)
    parser.add_argument("--site", help=argparse.SUPPRESS)
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--certs", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--ports", type=json.loads, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "site":
        result = asyncio.run(_site(args))
        (args.work / f"{args.site}.json").write_text(json.dumps(result))
        return 0
    if args.role == "flood":
        # On a real network the flooder's CPU is its own machine's; here it shares
        # the sites' cores: give way to them, so what is measured is what the flood
        # costs site a, not what running the attacker costs this machine.
        os.nice(19)
        (args.work / "flood.json").write_text(json.dumps(asyncio.run(_flood(args))))
        return 0
    return _drive(args)


def _drive(args: argparse.Namespace) -> int:
    from isthmus.job.file import free_port_blocks

    work = Path(tempfile.mkdtemp(prefix="isthmus-flood-"))
    make_certs(JOB, SITES, work / "certs")
    ports = dict(zip(("a", "b"), free_port_blocks("127.0.0.1", [1, 1]), strict=True))
    common = [
        sys.executable, __file__, "--work", str(work), "--certs", str(work / "certs"),
        "--ports", json.dumps(ports), "--rounds", str(args.rounds), "--mb", str(args.mb),
        "--streams", str(args.streams), "--flood-s", str(args.flood_s),
    ]  # fmt: skip
    print(f"{args.rounds} rounds of {args.mb} MB between a and b; {args.streams} streams "
          f"at a from round {args.rounds // 3} to {2 * args.rounds // 3}", flush=True)  # fmt: skip
    procs = [subprocess.Popen([*common, "--role", "site", "--site", s]) for s in ("a", "b")]
    flooder = subprocess.Popen([*common, "--role", "flood"])
    for proc in [*procs, flooder]:
        if proc.wait(timeout=1800) != 0:
            raise SystemExit(f"{proc.args[-1]} exited {proc.returncode}")
    a = json.loads((work / "a.json").read_text())
    b = json.loads((work / "b.json").read_text())
    flood = json.loads((work / "flood.json").read_text())
    rounds = a["rounds"][1:]  # the first round dials and warms up
    quiet = [r["seconds"] for r in rounds if not r["flooded"]]
    flooded = [r["seconds"] for r in rounds if r["flooded"]]
    before = [r["rss_kib"] for r in rounds if r["round"] < args.rounds // 3]
    under = [r["rss_kib"] for r in rounds if r["flooded"]]
    result = {
        "rounds": args.rounds,
        "mb_per_round": args.mb,
        "flood": flood,
        "median_round_s_undisturbed": statistics.median(quiet),
        "median_round_s_flooded": statistics.median(flooded),
        "round_time_ratio": statistics.median(flooded) / statistics.median(quiet),
        "rounds_flooded": len(flooded),
        "rss_mib_before_flood": max(before) / 1024,
        "rss_mib_peak_under_flood": max(under) / 1024,
        "rss_mib_growth_under_flood": (max(under) - max(before)) / 1024,
        "vm_hwm_mib": a["vm_hwm_kib"] / 1024,
        "refusals_at_a": a["refusals"],
        "identical_results": [r["digest"] for r in a["rounds"]]
        == [r["digest"] for r in b["rounds"]],
    }
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
