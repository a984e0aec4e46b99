"""Fault benchmarks: corrupted chunks are never applied; a cut link does not end a run.

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
``--chunks`` corrupted chunks between them. No round may fail either (a chunk
given up after MAX_REFUSALS refusals, a stream that never recovered): a failed
run is reported with each site's error, and how many chunks were refused k
times, by k, shows the margin left to that limit (a link that refuses at
random gives a geometric tail).

``partition``: an ``isthmus run`` of 3 sites (DiLoCo) whose link a-b is cut
for ``--for-s`` seconds, packets black-holed or connections reset: the run must
finish with the same model on every site. Printed: how long the longest site
took no step, and how much of that is beyond the partition (recovery).

``kill``: an ``isthmus run --restart-lost`` of 3 sites (DiLoCo) whose third
site is SIGKILLed after ``--after-rounds`` rounds and restarted by the launcher
2 s later. Printed: how soon after the kill each survivor completed a round
(target: within 10 s), and how soon after its restart the victim was training
again, against a round's duration plus the state transfer (the target; the
transfer's time counts from the request, so it includes waiting for the donor
to finish the round under way). Medians over ``--repeats`` runs.

    python benchmarks/faults.py corrupt [--chunks 10000] [--json FILE]
    python benchmarks/faults.py partition [--for-s 30] [--json FILE]
    python benchmarks/faults.py kill [--after-rounds 5] [--repeats 3] [--script PY] [--json FILE]
    python benchmarks/faults.py churn [--sites 4] [--minutes 10] [--kill-every-s 60]
    python benchmarks/faults.py slow [--factor 4] [--steps 150] [--json FILE]

``churn``: goodput while a random site is killed every T seconds (see churn.py).
``slow``: one of 4 sites at 1/F speed for a third of the run, per strategy (see
slow_site.py).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import churn as churn_benchmark
import slow_site
from site_kill import kill_after_rounds, loss_figures

from isthmus.deploy.bench.allreduce import SitesFailed, run_sites
from isthmus.inter.outbox import MAX_REFUSALS
from isthmus.training.records import read_records

MAX_FAILED_RUNS = 3
"""Runs of ``corrupt`` that may fail before it stops: enough to see it was no fluke."""


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
        "--round-digests",
    ]


def corrupt(args: argparse.Namespace) -> dict[str, Any]:
    clean = run_sites(args.sites, _flags(args, 0, 0.0), link="{rtt_ms: 0}")
    reference = {r["digest"] for r in clean.results}
    if len(reference) != 1:
        raise SystemExit(f"the clean run differs between sites: {sorted(reference)}")
    (expected,) = reference

    refusals: Counter[str] = Counter()
    totals = Counter(rounds=0, applied=0, resent=0, broken=0, injected=0, flipped_bytes=0)
    times_refused: Counter[int] = Counter()
    failed_runs: list[dict[str, str]] = []
    started = time.monotonic()
    while refusals["CHECKSUM_MISMATCH"] < args.chunks and len(failed_runs) < MAX_FAILED_RUNS:
        try:
            run = run_sites(
                args.sites,
                _flags(args, args.rounds_per_run, args.inject),
                link=f"{{rtt_ms: {args.rtt_ms}, corrupt: {args.wire_corrupt}}}",
            )
        except SitesFailed as exc:
            # A round that fails (a chunk given up, a stream that never recovered) is
            # no wrong result, but the faults must not stop a run either: counted.
            failed_runs.append(exc.errors)
            print(f"faults corrupt: a run failed: {exc}", file=sys.stderr, flush=True)
            continue
        for result in run.results:
            refusals.update(result["refusals"])
            totals["applied"] += sum(d != expected for d in result["round_digests"])
            totals["resent"] += result["resent_chunks"]
            totals["broken"] += result["broken_streams"]
            totals["injected"] += result["corrupted_on_purpose"]
            times_refused.update({int(k): v for k, v in result["times_refused"].items()})
        totals["rounds"] += args.rounds_per_run + 1
        totals["flipped_bytes"] += sum(
            d["corrupted_bytes"] for link in run.wire["links"] for k, d in link.items() if "->" in k
        )
        print(
            f"faults corrupt: {totals['rounds']} rounds, "
            f"{refusals['CHECKSUM_MISMATCH']:,} corrupted chunks refused, "
            f"{totals['applied']} rounds with a wrong result, {len(failed_runs)} runs failed",
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
        "most_refusals_of_one_chunk": max(times_refused, default=0),
        "chunks_by_times_refused": dict(sorted(times_refused.items())),
        "refusals_before_a_chunk_is_given_up": MAX_REFUSALS,
        "runs": len(failed_runs) + totals["rounds"] // (args.rounds_per_run + 1),
        "failed_runs": failed_runs,
        "seconds": round(time.monotonic() - started, 1),
    }


PARTITION_JOB = """\
name: fault-partition
sites:
  - {{name: a, ranks: 1}}
  - {{name: b, ranks: 1}}
  - {{name: c, ranks: 1}}
wan:
  default: {{rtt_ms: 20, bandwidth_mbit: 200}}
  faults:
    - {{at_s: {at_s}, link: [a, b], action: partition, for_s: {for_s}, mode: {mode}}}
train: {{strategy: diloco, steps: {steps}, sync_every: 10, warmup_steps: 5}}
"""


def partition(args: argparse.Namespace) -> dict[str, Any]:
    """One ``isthmus run`` of 3 sites whose link a-b is cut for ``--for-s`` seconds."""
    rows = {}
    for mode in args.modes:
        with tempfile.TemporaryDirectory(prefix="isthmus-faults-") as tmp:
            job = Path(tmp) / "job.yaml"
            job.write_text(
                PARTITION_JOB.format(at_s=args.at_s, for_s=args.for_s, mode=mode, steps=args.steps)
            )
            out = Path(tmp) / "run"
            print(f"faults partition: {mode}, {args.for_s:g} s ...", file=sys.stderr, flush=True)
            done = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "isthmus",
                    "run",
                    str(job),
                    "--out",
                    str(out),
                    "--no-report",
                ],
                capture_output=True,
                text=True,
                timeout=1800,
            )
            summary = json.loads((out / "summary.json").read_text())
            records = read_records(out / "metrics.jsonl")
        times: dict[str, list[float]] = {}
        for r in records:
            if r["kind"] == "step":
                times.setdefault(r["site"], []).append(r["t"])
        # The longest time a site took no step: the partition holds the round up.
        stalls = {
            site: max((b - a for a, b in itertools.pairwise(t)), default=0.0)
            for site, t in times.items()
        }
        longest = max(stalls.values())
        rows[mode] = {
            "exit_status": done.returncode,
            "status": summary["status"],
            "same_model_on_every_site": len({s["param_sha256"] for s in summary["sites"].values()})
            == 1,
            "inner_steps": {n: s["inner_steps"] for n, s in summary["sites"].items()},
            "longest_stall_s": round(longest, 1),
            "stall_beyond_partition_s": round(longest - args.for_s, 1),
            "wall_seconds": round(summary["wall_seconds"], 1),
        }
    return {"partition_s": args.for_s, "at_s": args.at_s, "modes": rows}


KILL_JOB = """\
name: faults-kill
sites:
  - {{name: us-east, ranks: 1}}
  - {{name: eu-west, ranks: 1}}
  - {{name: asia-east, ranks: 1}}
wan:
  default: {{rtt_ms: 80, bandwidth_mbit: 200}}
train: {{strategy: {strategy}, steps: {steps}, sync_every: {sync_every}}}
"""


def kill(args: argparse.Namespace) -> dict[str, Any]:
    """``--repeats`` runs of :func:`kill_once`, and the medians of their figures."""
    runs = [kill_once(args) for _ in range(args.repeats)]

    def median(key: str) -> float | None:
        values = [r[key] for r in runs if r[key] is not None]
        return statistics.median(values) if values else None

    for run in runs:
        run["survivors_next_round_after_kill_max_s"] = max(
            v for v in run["survivors_next_round_after_kill_s"].values() if v is not None
        )
        run["victim_target_s"] = (run["round_s_before_kill"] or 0) + (run["state_transfer_s"] or 0)
    keys = (
        "survivors_next_round_after_kill_max_s",
        "round_s_before_kill",
        "victim_restarted_after_kill_s",
        "victim_back_in_training_after_restart_s",
        "state_transfer_s",
        "victim_target_s",
    )
    return {
        "medians": {key: median(key) for key in keys},
        "every_run_finished_with_the_same_model": all(
            r["status"] == "finished" and r["same_model_on_every_site"] for r in runs
        ),
        "runs": runs,
    }


def kill_once(args: argparse.Namespace) -> dict[str, Any]:
    """One ``isthmus run --restart-lost`` of 3 sites, the third SIGKILLed mid-run."""
    victim = "asia-east"
    with tempfile.TemporaryDirectory(prefix="isthmus-faults-") as tmp:
        job = Path(tmp) / "job.yaml"
        job.write_text(
            KILL_JOB.format(steps=args.steps, sync_every=args.sync_every, strategy=args.strategy)
        )
        out = Path(tmp) / "run"
        command = [
            sys.executable,
            "-m",
            "isthmus",
            "run",
            str(job),
            "--out",
            str(out),
            "--no-report",
        ]
        command.append("--restart-lost")
        if args.script is not None:  # a user's script instead of the built-in loop
            command += ["--", sys.executable, str(args.script.resolve())]
        run = subprocess.Popen(
            command,
            cwd=tmp,  # the run writes ./JOB.control.json for `isthmus config`
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        print(f"faults kill: {victim} after {args.after_rounds} rounds ...", file=sys.stderr)
        killed = kill_after_rounds(out, victim, args.after_rounds)
        _, err = run.communicate(timeout=1800)
        summary = json.loads((out / "summary.json").read_text())
        figures = loss_figures(out, victim, killed)
    digests = {n: s.get("param_sha256") for n, s in summary["sites"].items()}
    return {
        "exit_status": run.returncode,
        "status": summary["status"],
        "same_model_on_every_site": len(set(digests.values())) == 1 and None not in digests,
        "inner_steps": {n: s.get("inner_steps") for n, s in summary["sites"].items()},
        **figures,
        "wall_seconds": round(summary["wall_seconds"], 1),
        "stderr_tail": err[-500:] if run.returncode else "",
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
    p = commands.add_parser("partition", help="a link cut for a while: the run goes on")
    p.add_argument("--for-s", type=float, default=30.0, help="how long the link is cut")
    p.add_argument("--at-s", type=float, default=15.0, help="when, after the emulator starts")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument(
        "--modes",
        nargs="+",
        default=["blackhole", "reset"],
        choices=["blackhole", "reset"],
        help="blackhole: packets vanish; reset: connections torn down and refused",
    )
    p.add_argument("--json", type=Path, help="also write the figures here")
    k = commands.add_parser("kill", help="a site SIGKILLed mid-run, then restarted: it rejoins")
    k.add_argument("--after-rounds", type=int, default=5, help="rounds the victim completes first")
    k.add_argument("--steps", type=int, default=400)
    k.add_argument("--sync-every", type=int, default=20)
    k.add_argument(
        "--strategy",
        choices=("diloco", "sync", "async", "streaming"),
        default="diloco",
        help="the strategy (with sync, a round is a step; with streaming, a fragment's exchange)",
    )
    k.add_argument("--repeats", type=int, default=3, help="runs; medians are printed")
    k.add_argument(
        "--script",
        type=Path,
        help="every rank runs this training script (isthmus run JOB -- python SCRIPT) "
        "instead of the built-in loop",
    )
    k.add_argument("--json", type=Path, help="also write the figures here")
    churn_benchmark.add_arguments(
        commands.add_parser("churn", help="a random site killed every T s: goodput, agreement")
    )
    slow_site.add_arguments(
        commands.add_parser("slow", help="one of 4 sites slowed for a third of the run")
    )
    args = parser.parse_args()
    if args.fault == "slow":
        figures = slow_site.slow_site(args)
        ok = slow_site.passed(figures)
    elif args.fault == "churn":
        figures = churn_benchmark.churn(args)
        ok = churn_benchmark.passed(figures)
    elif args.fault == "corrupt":
        figures = corrupt(args)
        ok = figures["rounds_with_a_wrong_result"] == 0 and not figures["failed_runs"]
    elif args.fault == "kill":
        figures = kill(args)
        ok = figures["every_run_finished_with_the_same_model"]
    else:
        figures = partition(args)
        ok = all(
            m["status"] == "finished" and m["same_model_on_every_site"]
            for m in figures["modes"].values()
        )
    print(json.dumps(figures, indent=2))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
