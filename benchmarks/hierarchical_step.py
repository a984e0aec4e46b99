"""The hierarchical step between a 1-rank and a 2-rank site, through the emulated WAN.

Prints what the sites issue asks to measure:

* every local rank's share of the WAN traffic (values it carried), and within
  each site the largest share over the smallest (target <= 1.25);
* the in-site cost of the step (reduce-scatter + all-gather over Gloo) next to
  its WAN time, medians over the steps;
* the trained parameters against one process training on the union of every
  rank's batches (target: equal within float32 tolerance), and whether both
  sites hold bitwise-identical parameters.

Usage::

    python benchmarks/hierarchical_step.py [--steps 20] [--rtt-ms 50] [--bandwidth-mbit 200]
        [--size tiny] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from site_worker import Recipe, load_site_parameters, reference_training

from isthmus.deploy.bench.emulator_bench import wan_up
from isthmus.intra.launch import launch_ranks
from isthmus.job.file import free_port_blocks, load_job

SITE_WORKER = Path(__file__).resolve().parent / "site_worker.py"

SITES = {"a": 1, "b": 2}
SEED, BATCH, LR, CORPUS = 0, 8, 0.05, 2_000_000


def run(args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory(prefix="isthmus-hier-") as tmp:
        tmpdir = Path(tmp)
        bases = free_port_blocks("127.0.0.1", list(SITES.values()))
        lines = ["name: bench-hierarchical", "sites:"]
        for (name, ranks), port in zip(SITES.items(), bases, strict=True):
            lines.append(f"  - {{name: {name}, ranks: {ranks}, address: '127.0.0.1:{port}'}}")
        lines += [
            "wan:",
            f"  default: {{rtt_ms: {args.rtt_ms}, bandwidth_mbit: {args.bandwidth_mbit}}}",
        ]
        job_path = tmpdir / "job.yaml"
        job_path.write_text("\n".join(lines) + "\n")
        state = tmpdir / "state.json"
        with wan_up(job_path, state):
            common = ["--job", str(job_path), "--state", str(state), "--out", str(tmpdir)]
            common += ["--steps", str(args.steps), "--batch", str(BATCH), "--lr", str(LR)]
            common += ["--seed", str(SEED), "--size", args.size, "--corpus-bytes", str(CORPUS)]
            procs = []
            for name, ranks in SITES.items():
                command = [sys.executable, str(SITE_WORKER), "--site", name]
                procs += launch_ranks([*command, *common], ranks, stderr=subprocess.PIPE)
            print(
                f"hierarchical step: sites {SITES} (ranks), {args.steps} steps of model "
                f"{args.size}, {args.rtt_ms:g} ms / {args.bandwidth_mbit:g} Mbit/s links",
                file=sys.stderr,
                flush=True,
            )
            for p in procs:
                _, err = p.communicate(timeout=1800)
                if p.returncode != 0:
                    raise SystemExit(f"a site rank failed:\n{err.decode()[-3000:]}")
        reports = [json.loads(p.read_text()) for p in sorted(tmpdir.glob("*-*.json"))]
        job = load_job(job_path)
        recipe = Recipe(seed=SEED, size=args.size, corpus_bytes=CORPUS, batch=BATCH)
        reference = reference_training(job, recipe, steps=args.steps, lr=LR).state_dict()
        trained = {s: load_site_parameters(tmpdir, s) for s in SITES}
    max_diff = max(
        float((trained[s][k] - v).abs().max()) for s in SITES for k, v in reference.items()
    )
    identical = all(torch.equal(trained["a"][k], trained["b"][k]) for k in reference)
    shares = {}
    for site in SITES:
        values = [r["wan_values"] for r in reports if r["site"] == site]
        shares[site] = {"per_rank": values, "max_over_min": max(values) / max(1, min(values))}
    return {
        "steps": args.steps,
        "model": args.size,
        "link": {"rtt_ms": args.rtt_ms, "bandwidth_mbit": args.bandwidth_mbit},
        "ranks": [
            {
                "site": r["site"],
                "rank": r["rank"],
                "lanes": r["lanes"],
                "wan_values": r["wan_values"],
                "in_site_s": round(r["in_site_s"], 4),
                "wan_s": round(r["wan_s"], 4),
            }
            for r in reports
        ],
        "shares": shares,
        "in_site_s_median": round(statistics.median(r["in_site_s"] for r in reports), 4),
        "wan_s_median": round(statistics.median(r["wan_s"] for r in reports), 4),
        "max_abs_diff_vs_reference": max_diff,
        "sites_identical": identical,
        "ok": max_diff <= 1e-5
        and identical
        and all(s["max_over_min"] <= 1.25 for s in shares.values()),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rtt-ms", type=float, default=50.0)
    parser.add_argument("--bandwidth-mbit", type=float, default=200.0)
    parser.add_argument("--size", default="tiny")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    r = run(args)
    if args.json:
        print(json.dumps(r, indent=2))
        return 0 if r["ok"] else 1
    print(f"hierarchical step, {r['steps']} steps, model {r['model']}, link {r['link']}")
    for row in r["ranks"]:
        print(
            f"  site {row['site']} rank {row['rank']}: lanes {row['lanes']}, "
            f"{row['wan_values']:,} values over the WAN per step; "
            f"in-site {row['in_site_s']:.4f} s, WAN {row['wan_s']:.4f} s (medians)"
        )
    for site, s in r["shares"].items():
        print(
            f"  site {site}: largest / smallest rank share {s['max_over_min']:.2f} (target <= 1.25)"
        )
    print(
        f"  in-site cost {r['in_site_s_median']:.4f} s next to WAN {r['wan_s_median']:.4f} s "
        f"per step (medians over ranks)"
    )
    print(
        f"  vs one process on the union of batches: max |diff| {r['max_abs_diff_vs_reference']:.2e}"
        f" (target <= 1e-5); sites bitwise identical: {r['sites_identical']}"
    )
    print("all targets met" if r["ok"] else "some targets MISSED")
    return 0 if r["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
