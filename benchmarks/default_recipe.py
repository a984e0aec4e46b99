"""The DiLoCo family's recipes on a job's links, as a user judges them: loss per hour.

    python benchmarks/default_recipe.py [--job deploy/examples/three-continents.yaml]
        [--steps 600] [--only NAME ...] [--out DIR] [--json FILE]

Runs ``isthmus run JOB --no-report`` once per recipe (the job's ``train:`` with
the recipe's settings on top, ``--steps`` steps), then prints each one's
held-out loss (the model the sites share, after every round), WAN bytes,
compute utilisation, wall time, and when its held-out loss first reached a
few levels and sync's final loss. This is the measurement behind the job
file's DiLoCo-family defaults (docs/benchmarks.md, "Default recipe"): the
outer optimizer, the codec and H.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from isthmus.deploy.launch.compare import held_out_curve, seconds_to_loss
from isthmus.training.records import read_records

PLAIN = {"outer_lr": 1.0, "outer_momentum": 0.0}
NESTEROV = {"outer_lr": 0.7, "outer_momentum": 0.9}
TERNARY = {"codec": "int2+zstd", "error_feedback": True}
FLOAT32 = {"codec": "none", "error_feedback": False}
ADAMW = {"inner_optimizer": "adamw"}
RECIPES = {
    "sync": {"strategy": "sync", "codec": "none"},
    "diloco-h50-nesterov-fp32": {"strategy": "diloco", "sync_every": 50, **NESTEROV, **FLOAT32},
    "diloco-h50": {"strategy": "diloco", "sync_every": 50, **PLAIN, **TERNARY},
    "diloco-h20": {"strategy": "diloco", "sync_every": 20, **PLAIN, **TERNARY},
    "diloco-h10": {"strategy": "diloco", "sync_every": 10, **PLAIN, **TERNARY},
    "diloco-h4": {"strategy": "diloco", "sync_every": 4, **PLAIN, **TERNARY},
    # The all-reduce by name (the job's default is auto: one trip or two by size).
    **{
        f"diloco-h10-{algorithm}": {
            "strategy": "diloco",
            "sync_every": 10,
            **PLAIN,
            **TERNARY,
            "algorithm": algorithm,
        }
        for algorithm in ("direct", "gather")
    },
    # The DiLoCo family's inner optimizer is SiteAdamW unless the job says otherwise:
    # these are the same recipes with plain AdamW.
    "diloco-h10-adamw": {"strategy": "diloco", "sync_every": 10, **PLAIN, **TERNARY, **ADAMW},
    "diloco-h4-adamw": {"strategy": "diloco", "sync_every": 4, **PLAIN, **TERNARY, **ADAMW},
    "diloco-h10-fp32": {"strategy": "diloco", "sync_every": 10, **PLAIN, **FLOAT32},
    "diloco-h10-nesterov": {"strategy": "diloco", "sync_every": 10, **NESTEROV, **TERNARY},
    "async-h10": {"strategy": "async", "sync_every": 10, **PLAIN, **TERNARY},
    "async-h20": {"strategy": "async", "sync_every": 20, **PLAIN, **TERNARY},
    "async-h10-int4": {
        "strategy": "async",
        "sync_every": 10,
        **PLAIN,
        "codec": "int4",
        "error_feedback": True,
    },
    "async-h10-nesterov": {"strategy": "async", "sync_every": 10, **NESTEROV, **TERNARY},
    # Streaming's own defaults (2 fragments, overlap 1 step, mixing 0.5) at H=10.
    "streaming-h10": {"strategy": "streaming", "sync_every": 10, **PLAIN, **TERNARY},
    "streaming-h10-adamw": {
        "strategy": "streaming",
        "sync_every": 10,
        **PLAIN,
        **TERNARY,
        **ADAMW,
    },
    # Overlapping part of a round: the exchange in flight for about one round trip
    # of compute, not a whole round, so what each average misses is a few steps.
    "overlapped-h10-eager-o3": {
        "strategy": "streaming",
        "fragments": 1,
        "overlap_steps": 3,
        "merge": "eager",
        "sync_every": 10,
        **PLAIN,
        **TERNARY,
    },
    "overlapped-h10-eager-o5": {
        "strategy": "streaming",
        "fragments": 1,
        "overlap_steps": 5,
        "merge": "eager",
        "sync_every": 10,
        **PLAIN,
        **TERNARY,
    },
    # Overlapped by about one trip of the gather all-reduce (0.12 s on these links,
    # 3-4 steps of 34 ms), with the inner SiteAdamW: rounds short enough that the
    # average lags the sites by few steps.
    **{
        f"overlapped-h{h}-eager-o{o}-site": {
            "strategy": "streaming",
            "fragments": 1,
            "overlap_steps": o,
            "merge": "eager",
            "sync_every": h,
            **PLAIN,
            **TERNARY,
            "inner_optimizer": "site_adamw",
        }
        for h, o in ((4, 4), (5, 3), (6, 3), (6, 2), (8, 3), (10, 3), (10, 0))
    },
    "overlapped-h10-eager": {
        "strategy": "streaming",
        "fragments": 1,
        "overlap_steps": 9,
        "merge": "eager",
        "sync_every": 10,
        **PLAIN,
        **TERNARY,
    },
}
LEVELS = (2.5, 2.4, 2.3, 2.2, 2.1)


def run(job: dict, name: str, steps: int, root: Path) -> dict:
    folder = root / name
    folder.mkdir(parents=True, exist_ok=True)
    job = {**job, "train": {**(job.get("train") or {}), **RECIPES[name], "steps": steps}}
    (folder / "job.yaml").write_text(yaml.safe_dump(job, sort_keys=False))
    out = folder / "run"
    command = [sys.executable, "-m", "isthmus", "run", str(folder / "job.yaml")]
    done = subprocess.run(
        [*command, "--out", str(out), "--no-report"],
        capture_output=True,
        text=True,
        cwd=folder,
    )
    if done.returncode:
        raise RuntimeError(f"{name}: isthmus run failed: {done.stderr[-1500:]}")
    summary = json.loads((out / "summary.json").read_text())
    # As --compare reads it: the first site's evaluations of the shared model.
    curve = held_out_curve(read_records(out / "metrics.jsonl"), summary["started"])
    return {
        "recipe": name,
        "settings": RECIPES[name],
        "steps": steps,
        "held_out_loss": curve[-1][1],  # at the end of the run, after its last round
        "wan_bytes": summary["wan_bytes"],
        "compute_utilization": summary["compute_utilization"],
        "wall_seconds": summary["wall_seconds"],
        "curve": curve,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--job", type=Path, default=Path("deploy/examples/three-continents.yaml"))
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--only", nargs="+", choices=sorted(RECIPES), help="these recipes only")
    parser.add_argument("--out", type=Path, help="keep the runs here (default: a temp dir)")
    parser.add_argument("--json", type=Path, help="write the rows here")
    args = parser.parse_args()
    if args.steps < 1:
        parser.error("--steps must be >= 1")
    job = yaml.safe_load(args.job.read_text())
    root = (args.out or Path(tempfile.mkdtemp(prefix="isthmus-recipes-"))).resolve()
    rows = []
    for name in args.only or RECIPES:
        print(f"{name}: {args.steps} steps ...", file=sys.stderr, flush=True)
        rows.append(run(job, name, args.steps, root))
    sync = next((r for r in rows if r["recipe"] == "sync"), None)
    for row in rows:
        ratio = f"{sync['wan_bytes'] / row['wan_bytes']:.0f}x" if sync else "-"
        times = ", ".join(
            f"{level}: "
            + (f"{t:.0f} s" if (t := seconds_to_loss(row["curve"], level)) is not None else "-")
            for level in LEVELS
        )
        to_sync = ""
        if sync and row is not sync:
            # As --compare times it: when the curve first reached sync's best loss.
            target = min(loss for _, loss in sync["curve"])
            t = seconds_to_loss(row["curve"], target)
            if t is not None:
                ratio_t = t / seconds_to_loss(sync["curve"], target)
                to_sync = f"; sync's loss at {t:.0f} s ({ratio_t:.3f} of sync's)"
        print(
            f"{row['recipe']:26s} loss {row['held_out_loss']:.3f}, "
            f"{row['wan_bytes'] / 1e6:.1f} MB ({ratio} fewer), "
            f"utilisation {row['compute_utilization']:.0%}, wall {row['wall_seconds']:.0f} s; "
            f"reached {times}{to_sync}",
            flush=True,
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    print(f"runs in {root}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
