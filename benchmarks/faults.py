"""Fault benchmark: corrupted chunks must never be applied; print what they cost.

The failure-handling issue's target: 10,000 corrupted chunks, 0 applied. Site
processes run all-reduces of the same tensors, round after round, through
``isthmus wan up`` with two faults at once:

- the emulator's corruption fault on the wire (``--wire-corrupt``: a fraction of
  bytes gets a bit flipped, in chunk payloads, in gRPC's framing, in acks);
- corruption injected into payloads after their checksum was computed
  (``--inject``: that fraction of outgoing chunks).

A clean run first gives the reference result. Every round of the faulty runs
must give a result bitwise equal to it, on every site: one applied corrupted
chunk would change a round's digest. Runs repeat until the receivers refused
``--chunks`` corrupted chunks between them.

    python benchmarks/faults.py corrupt [--chunks 10000] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from isthmus.deploy.bench_allreduce import run_sites


def _flags(args: argparse.Namespace, repeats: int, inject: float) -> list[str]:
    return [
        "--size-mib",
        str(args.size_mib),
        "--chunk-kib",
        str(args.chunk_kib),
        "--repeats",
        str(repeats),
        "--stall-s",
        str(args.stall_s),
        "--deadline-s",
        "120",
        "--corrupt-payloads",
        str(inject),
    ]


def corrupt(args: argparse.Namespace) -> dict[str, Any]:
    clean = run_sites(args.sites, _flags(args, 0, 0.0), link="{rtt_ms: 0}")
    reference = {r["digest"] for r in clean.results}
    if len(reference) != 1:
        raise SystemExit(f"the clean run differs between sites: {sorted(reference)}")
    (expected,) = reference

    refusals: Counter[str] = Counter()
    totals = Counter(rounds=0, applied=0, resent=0, broken=0, injected=0, flipped_bytes=0)
    started = time.monotonic()
    while refusals["CHECKSUM_MISMATCH"] < args.chunks:
        run = run_sites(
            args.sites,
            _flags(args, args.rounds_per_run, args.inject),
            link=f"{{rtt_ms: {args.rtt_ms}, corrupt: {args.wire_corrupt}}}",
        )
        for result in run.results:
            refusals.update(result["refusals"])
            totals["applied"] += sum(d != expected for d in result["round_digests"])
            totals["resent"] += result["resent_chunks"]
            totals["broken"] += result["broken_streams"]
            totals["injected"] += result["corrupted_on_purpose"]
        totals["rounds"] += args.rounds_per_run + 1
        totals["flipped_bytes"] += sum(
            d["corrupted_bytes"] for link in run.wire["links"] for k, d in link.items() if "->" in k
        )
        print(
            f"faults corrupt: {totals['rounds']} rounds, "
            f"{refusals['CHECKSUM_MISMATCH']:,} corrupted chunks refused, "
            f"{totals['applied']} rounds with a wrong result",
            file=sys.stderr,
            flush=True,
        )
    refused = refusals["CHECKSUM_MISMATCH"]
    return {
        "sites": args.sites,
        "size_mib": args.size_mib,
        "chunk_kib": args.chunk_kib,
        "wire_corrupt_per_byte": args.wire_corrupt,
        "injected_fraction": args.inject,
        "rounds": totals["rounds"],
        "corrupted_chunks_refused": refused,
        "of_which_injected": totals["injected"],
        "of_which_on_the_wire": refused - totals["injected"],
        "bytes_flipped_on_the_wire": totals["flipped_bytes"],
        "other_refusals": {k: v for k, v in refusals.items() if k != "CHECKSUM_MISMATCH"},
        "chunks_resent": totals["resent"],
        "streams_broken_or_stalled": totals["broken"],
        "rounds_with_a_wrong_result": totals["applied"],
        "seconds": round(time.monotonic() - started, 1),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="fault", required=True)
    c = commands.add_parser("corrupt", help="corrupted chunks: refused, resent, never applied")
    c.add_argument("--chunks", type=int, default=10_000, help="corrupted chunks to reach")
    c.add_argument("--sites", type=int, default=3)
    c.add_argument("--size-mib", type=float, default=4.0, help="tensor per site")
    c.add_argument("--chunk-kib", type=float, default=16.0, help="largest chunk")
    c.add_argument("--rtt-ms", type=float, default=2.0)
    c.add_argument("--wire-corrupt", type=float, default=5e-6, help="per byte, both ways")
    c.add_argument("--inject", type=float, default=0.2, help="fraction of chunks sent")
    c.add_argument("--rounds-per-run", type=int, default=20)
    c.add_argument("--stall-s", type=float, default=2.0, help="see TransportSettings.stall_s")
    c.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    figures = corrupt(args)
    print(json.dumps(figures, indent=2))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    return 0 if figures["rounds_with_a_wrong_result"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
