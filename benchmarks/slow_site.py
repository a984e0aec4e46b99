"""One of four sites at 1/F speed for a third of the run: what it costs the others.

    python benchmarks/faults.py slow [--factor 4] [--steps 150] [--json FILE]

For each strategy (DiLoCo with time-budgeted rounds, async, plain DiLoCo, sync):
a clean ``isthmus run`` of 4 one-rank sites (the built-in tiny model, H=10, 100
Mbit/s and 20 ms links), then the same run with site d slowed F times
(``wan.faults: [{slow: d, factor: F, at_s: W/3, for_s: W/3}]``, W the clean
run's training time, so a third of it). Reported per strategy: the other sites'
compute utilisation with the fault over without it (mean of a, b, c), the
held-out loss of the final model with the fault over without it, and the wall
time. DiLoCo's ``round_seconds`` is the clean plain-DiLoCo run's round time, so a
slow site ends its rounds on time with fewer steps. Targets: utilisation ratio
>= 0.9 under DiLoCo with round_seconds and under async, loss within 2%.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

from isthmus.deploy.launch.summary import compute_utilization

SITES = ("a", "b", "c", "d")
SLOW = "d"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--factor", type=float, default=4.0, help="how many times slower")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--sync-every", type=int, default=10)
    parser.add_argument("--json", type=Path, help="also write the figures here")


def _job(train: dict[str, Any], faults: list[dict[str, Any]], steps: int, every: int) -> str:
    settings = {"steps": steps, "sync_every": every, "warmup_steps": 5, "eval_every": 0}
    return yaml.safe_dump(
        {
            "name": "slow-site",
            "sites": [{"name": s, "ranks": 1} for s in SITES],
            "wan": {"default": {"rtt_ms": 20, "bandwidth_mbit": 100}, "faults": faults},
            "train": {**settings, **train},
        }
    )


def _run(folder: Path, name: str, text: str) -> dict[str, Any]:
    (folder / f"{name}.yaml").write_text(text)
    out = folder / name
    done = subprocess.run(
        [sys.executable, "-m", "isthmus", "run", f"{name}.yaml", "--out", str(out), "--no-report"],
        cwd=folder, capture_output=True, text=True, timeout=1800,
    )  # fmt: skip
    if done.returncode:
        raise SystemExit(f"{name} failed: {done.stderr[-2000:]}")
    return json.loads((out / "summary.json").read_text())


def _others_utilization(summary: dict[str, Any]) -> float:
    return statistics.fmean(
        compute_utilization(summary["sites"][s]) or 0.0 for s in SITES if s != SLOW
    )


def _loss(summary: dict[str, Any]) -> float:
    return statistics.fmean(s["eval_loss"] for s in summary["sites"].values())


def slow_site(args: argparse.Namespace) -> dict[str, Any]:
    figures: dict[str, Any] = {"factor": args.factor, "steps": args.steps, "strategies": {}}
    with tempfile.TemporaryDirectory(prefix="isthmus-slow-site-") as scratch:
        folder = Path(scratch)
        plain = _run(folder, "diloco-clean", _job({"strategy": "diloco"}, [], args.steps,
                                                  args.sync_every))  # fmt: skip
        step_s = statistics.median(
            s["compute_seconds"] / s["inner_steps"] for s in plain["sites"].values()
        )
        round_s = round(step_s * args.sync_every * 1.2, 3)
        strategies = {
            "diloco, round_seconds": {"strategy": "diloco", "round_seconds": round_s},
            "async": {"strategy": "async"},
            "diloco": {"strategy": "diloco"},
            "sync": {"strategy": "sync"},
        }
        for label, train in strategies.items():
            tag = label.replace(", ", "-").replace(" ", "")
            clean = plain if label == "diloco" else _run(
                folder, f"{tag}-clean", _job(train, [], args.steps, args.sync_every)
            )  # fmt: skip
            training_s = statistics.median(s["wall_seconds"] for s in clean["sites"].values())
            fault = {"slow": SLOW, "factor": args.factor, "at_s": round(training_s / 3, 2),
                     "for_s": round(training_s / 3, 2)}  # fmt: skip
            slowed = _run(folder, f"{tag}-slow", _job(train, [fault], args.steps,
                                                      args.sync_every))  # fmt: skip
            digests = {s["param_sha256"] for s in slowed["sites"].values()}
            row = {
                "train": train,
                "fault": fault,
                "others_utilization_clean": round(_others_utilization(clean), 3),
                "others_utilization_slow": round(_others_utilization(slowed), 3),
                "utilization_ratio": round(
                    _others_utilization(slowed) / _others_utilization(clean), 3
                ),
                "eval_loss_clean": round(_loss(clean), 4),
                "eval_loss_slow": round(_loss(slowed), 4),
                "loss_ratio": round(_loss(slowed) / _loss(clean), 4),
                "wall_clean_s": round(clean["wall_seconds"], 1),
                "wall_slow_s": round(slowed["wall_seconds"], 1),
                "slow_site_steps": slowed["sites"][SLOW]["inner_steps"],
                "one_model": len(digests) == 1,
            }
            figures["strategies"][label] = row
            print(
                f"{label:22s} others' utilisation {row['others_utilization_clean']:.3f} -> "
                f"{row['others_utilization_slow']:.3f} ({row['utilization_ratio']:.3f}x), loss "
                f"{row['eval_loss_clean']:.4f} -> {row['eval_loss_slow']:.4f} "
                f"({row['loss_ratio']:.4f}x), wall {row['wall_clean_s']} -> "
                f"{row['wall_slow_s']} s, d trained {row['slow_site_steps']} steps",
                file=sys.stderr,
                flush=True,
            )
    return figures


def passed(figures: dict[str, Any]) -> bool:
    rows = figures["strategies"]
    return all(
        rows[s]["utilization_ratio"] >= 0.9 and abs(rows[s]["loss_ratio"] - 1) <= 0.02
        for s in ("diloco, round_seconds", "async")
    ) and all(r["one_model"] for r in rows.values())
