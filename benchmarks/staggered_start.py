"""Sites started one by one, seconds apart, as operators on separate clusters would.

    python benchmarks/staggered_start.py [--sites 16] [--stagger-s 1] [--json FILE]

Starts a real Mosquitto and then ``isthmus site JOB --site NAME`` for every site
of a job of one-rank sites, one every ``--stagger-s`` seconds, each with its own
run directory, meeting only through the job file's addresses and the broker
(loopback, no emulated links). Start-up is not a failure: every site must make
the first round, train every step and end with the same model.

Reported: the spread of the starts, how long the first site waited for the last
(its first round's end), whether any view left a site out or let one join later
(there should be none), the rounds every site completed, the sites' exit
statuses, whether every site ends with the same ``param_sha256``, and the whole
wall time.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from local_broker import start_mosquitto

from isthmus.job.ports import free_port_blocks
from isthmus.training.records import read_records

JOB = """\
name: staggered
sites:
{sites}
train: {{strategy: diloco, steps: {steps}, sync_every: {sync_every}, warmup_steps: 2,
        eval_every: 0}}
control: {{broker: "mqtt://127.0.0.1:{broker}"}}
"""


def _say(message: str) -> None:
    print(f"staggered start: {message}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> dict[str, Any]:
    names = [f"s{i:02d}" for i in range(args.sites)]
    with tempfile.TemporaryDirectory(prefix="isthmus-staggered-") as name:
        tmp = Path(name)
        try:
            broker, port = start_mosquitto(tmp)
        except RuntimeError as exc:
            raise SystemExit(f"staggered start: {exc}") from None
        try:
            (base,) = free_port_blocks("127.0.0.1", [args.sites])
            sites = "\n".join(
                f"  - {{name: {n}, address: 127.0.0.1:{base + i}}}" for i, n in enumerate(names)
            )
            job = tmp / "job.yaml"
            job.write_text(
                JOB.format(sites=sites, steps=args.steps, sync_every=args.sync_every, broker=port)
            )
            started: dict[str, float] = {}
            procs: dict[str, subprocess.Popen[str]] = {}
            t0 = time.time()
            for i, site in enumerate(names):
                time.sleep(max(0.0, t0 + i * args.stagger_s - time.time()))
                started[site] = time.time() - t0
                procs[site] = subprocess.Popen(
                    [sys.executable, "-m", "isthmus", "site", str(job), "--site", site,
                     "--out", str(tmp / site)],
                    cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                )  # fmt: skip
            _say(f"started {len(names)} sites over {started[names[-1]]:.1f} s")
            outputs = {s: p.communicate(timeout=args.timeout_s)[0] for s, p in procs.items()}
            wall = time.time() - t0
        finally:
            for proc in procs.values() if "procs" in locals() else []:
                proc.kill()
            broker.terminate()
            broker.wait(10)
        codes = {s: p.returncode for s, p in procs.items()}
        results, views, first_round_end = {}, [], {}
        for site in names:
            result = tmp / site / "sites" / site / "result.json"
            results[site] = json.loads(result.read_text()) if result.exists() else {}
            metrics = tmp / site / "sites" / site / "metrics.jsonl"
            records = read_records(metrics) if metrics.exists() else []
            views += [r for r in records if r["kind"] == "view"]
            rounds = [r["t"] for r in records if r["kind"] == "round"]
            if rounds:
                first_round_end[site] = rounds[0] - t0
        digests = {r.get("param_sha256") for r in results.values()}
        return {
            "sites": args.sites,
            "stagger_s": args.stagger_s,
            "start_spread_s": round(started[names[-1]], 2),
            "first_round_ended_s": {
                "first": round(min(first_round_end.values(), default=0.0), 1),
                "last": round(max(first_round_end.values(), default=0.0), 1),
            },
            "views_after_the_first": sorted({(v["epoch"], v["reason"]) for v in views}),
            "outer_steps": sorted({r.get("outer_steps") for r in results.values()}, key=str),
            "exit_codes": sorted(set(codes.values())),
            "failed": {s: outputs[s][-600:] for s, c in codes.items() if c != 0},
            "same_model_on_every_site": len(digests) == 1 and None not in digests,
            "wall_s": round(wall, 1),
        }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sites", type=int, default=16)
    parser.add_argument("--stagger-s", type=float, default=1.0, help="seconds between starts")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--sync-every", type=int, default=5)
    parser.add_argument("--timeout-s", type=float, default=900.0)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    if not 2 <= args.sites <= 64:
        parser.error(f"--sites: must be in 2..64, got {args.sites}")
    if args.stagger_s < 0:
        parser.error(f"--stagger-s: must be >= 0, got {args.stagger_s}")
    figures = run(args)
    text = json.dumps(figures, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return 0 if figures["same_model_on_every_site"] and figures["exit_codes"] == [0] else 1


if __name__ == "__main__":
    sys.exit(main())
