"""The tuner's pick against an independent grid of full-length runs.

    python benchmarks/tuner_grid.py [--out DIR] [--budget-minutes M] [--write-docs]

1. ``isthmus tune`` on the job below (two sites on a 20 Mbit/s, 80 ms link,
   DiLoCo; the tuner may choose H in 5-200 and codec none or int8), with its
   own calibration and trials, as a user would run it.
2. The grid: one full-length ``isthmus run`` (the job's 300 steps) of every
   (H, codec) the tuner could have chosen, not only those it tried; the pick is
   measured here again, in its own full-length run.
3. Time to target loss for each run: the wall seconds until its training loss
   (mean over sites, running mean over 20 steps) first reaches the target. The
   target is the median of the grid runs' final smoothed losses (half the grid
   reaches it), stated in the output. Target: the pick within 5% of the grid's
   best.

The runs share this 2-core machine with nothing else of the benchmark's: they
run one after another. ``--write-docs`` writes docs/tuner-grid.json and .png.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from isthmus.deploy.tune_trials import loss_curve, time_to_loss

JOB = """\
# The tuner's benchmark: two sites on a thin transatlantic share.
name: tuner-grid
sites: [{name: us-east}, {name: eu-west}]
wan: {default: {rtt_ms: 80, bandwidth_mbit: 20}}
train: {strategy: diloco, steps: 300, sync_every: 50}
tune: {target_utilization: 0.85, codecs: [none, int8], min_sync_every: 5, max_sync_every: 200}
"""
GRID_H = (5, 10, 20, 50, 100, 200)
GRID_CODECS = ("none", "int8")
TARGET_RATIO = 1.05


def isthmus(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "isthmus", *args], cwd=cwd, capture_output=True, text=True
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="where the runs go (default: a temp folder)")
    parser.add_argument("--budget-minutes", type=float, default=5.0, help="for isthmus tune")
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args()
    root = args.out or Path(tempfile.mkdtemp(prefix="isthmus-tuner-grid-"))
    root.mkdir(parents=True, exist_ok=True)
    job = root / "job.yaml"
    job.write_text(JOB)
    started = time.monotonic()

    print(f"isthmus tune (budget {args.budget_minutes:g} min) ...", flush=True)
    tuned = isthmus(
        "tune", str(job), "--budget-minutes", str(args.budget_minutes), "--json",
        "--out", str(root / "tune"), cwd=root,
    )  # fmt: skip
    if tuned.returncode:
        print(tuned.stderr, file=sys.stderr)
        return 1
    tune = json.loads(tuned.stdout)
    pick = tune["choice"]["settings"]
    print(f"  pick: {tune['choice']['label']} ({time.monotonic() - started:.0f} s)", flush=True)

    runs = []
    grid = [(h, codec) for h in GRID_H for codec in GRID_CODECS]
    for index, (h, codec) in enumerate(grid, 1):
        out = root / "grid" / f"H{h}-{codec}"
        done = _run(job, out, h, codec, root)
        if done.returncode:
            print(done.stderr[-2000:], file=sys.stderr)
            return 1
        curve = loss_curve(out)
        summary = json.loads((out / "summary.json").read_text())
        runs.append(
            {
                "sync_every": h,
                "codec": codec,
                "run_dir": str(out),
                "wall_seconds": summary["wall_seconds"],
                "final_loss": curve[-1][1],
                "eval_loss": next(iter(summary["sites"].values()))["eval_loss"],
                "curve": curve,
            }
        )
        print(
            f"  grid {index}/{len(grid)}: H={h} {codec}: {summary['wall_seconds']:.0f} s, "
            f"final smoothed loss {curve[-1][1]:.3f}",
            flush=True,
        )
    target = statistics.median(r["final_loss"] for r in runs)
    for r in runs:
        r["time_to_target_s"] = time_to_loss(r.pop("curve"), target)
    reached = [r for r in runs if r["time_to_target_s"] is not None]
    best = min(reached, key=lambda r: r["time_to_target_s"])
    picked = next(
        r for r in runs if (r["sync_every"], r["codec"]) == (pick["sync_every"], pick["codec"])
    )
    ratio = (
        picked["time_to_target_s"] / best["time_to_target_s"]
        if picked["time_to_target_s"] is not None
        else float("inf")
    )
    print(f"\ntarget loss {target:.4f} (median of the grid's final smoothed training losses)")
    print(f"{'setting':14s} {'wall':>7s} {'to target':>10s} {'final':>7s} {'held-out':>9s}")
    for r in runs:
        mark = " <- pick" if r is picked else (" <- best" if r is best else "")
        to = r["time_to_target_s"]
        print(
            f"H={r['sync_every']:<4d} {r['codec']:8s} {r['wall_seconds']:6.0f}s "
            f"{(f'{to:.1f}s' if to is not None else 'never'):>10s} {r['final_loss']:7.3f} "
            f"{r['eval_loss']:9.3f}{mark}"
        )
    verdict = "met" if ratio <= TARGET_RATIO else "missed"
    print(
        f"\npick {tune['choice']['label']}: time to target {ratio:.3f}x the grid's best "
        f"(H={best['sync_every']} {best['codec']}); target <= {TARGET_RATIO}x: {verdict}"
    )
    result = {
        "job": JOB,
        "tune": {k: tune[k] for k in ("choice", "model_pick", "rows", "step_s")},
        "target_loss": target,
        "grid": runs,
        "pick": tune["choice"]["label"],
        "best": f"H={best['sync_every']} {best['codec']}",
        "ratio": ratio,
        "seconds": time.monotonic() - started,
    }
    (root / "tuner-grid.json").write_text(json.dumps(result, indent=2))
    if args.write_docs:
        docs = Path(__file__).resolve().parent.parent / "docs"
        (docs / "tuner-grid.json").write_text(json.dumps(result, indent=2) + "\n")
        plot(result, docs / "tuner-grid.png")
    return 0


def _run(job: Path, out: Path, h: int, codec: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """A full-length run with one grid setting: the job file with its train: keys set."""
    from isthmus.deploy.job_edit import edit_train_keys

    variant = out.parent / f"{out.name}.yaml"
    variant.parent.mkdir(parents=True, exist_ok=True)
    variant.write_text(edit_train_keys(job.read_text(), {"sync_every": h, "codec": codec}))
    return isthmus("run", str(variant), "--out", str(out), cwd=cwd)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["grid"]
    labels = [f"H={r['sync_every']}\n{r['codec']}" for r in runs]
    values = [r["time_to_target_s"] or 0 for r in runs]
    fig, ax = plt.subplots(figsize=(10, 4))
    bars = ax.bar(range(len(runs)), values, color="#8aa")
    for bar, r in zip(bars, runs, strict=True):
        name = f"H={r['sync_every']} {r['codec']}"
        if r["time_to_target_s"] is None:
            bar.set_color("#ddd")
            ax.text(bar.get_x() + bar.get_width() / 2, 1, "never", ha="center", fontsize=8)
        if name == result["pick"]:
            bar.set_color("#c63")
    ax.set_xticks(range(len(runs)), labels, fontsize=8)
    ax.set_ylabel(f"seconds to training loss {result['target_loss']:.3f}")
    ax.set_title(
        f"full-length grid; tuner's pick {result['pick']} (orange): "
        f"{result['ratio']:.2f}x the best ({result['best']})"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
