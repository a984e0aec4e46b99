"""Compute time of one inner step on this machine, measured at a job's concurrency.

In an emulated run the sites, the emulator, the launcher and the broker share
this machine's cores, so a step timed alone is faster than a step in the run
(timing only the training processes, at the job's concurrency, still came out
10% fast; docs/performance-model.md). The calibration is therefore a short
``isthmus run`` of the job itself, DiLoCo every few steps so that the sites
stay in step (without rounds they drift apart, and a site computing while
another still starts up, or after it ended, sees other contention than in a
run): the median over sites of compute seconds per inner step, as the run's
own records count them, after the first round (the sites start cold and at
different moments).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from isthmus.deploy.jobfile import load_yaml

LOCKSTEP_EVERY = 10
"""Inner steps between the calibration run's rounds."""


def run_step_seconds(job_path: Path, *, steps: int = 50) -> float:
    """Median compute seconds per inner step in a short DiLoCo run of the job whose
    rounds keep the sites in step."""
    return statistics.median(run_site_step_seconds(job_path, steps=steps).values())


def run_site_step_seconds(job_path: Path, *, steps: int = 50) -> dict[str, float]:
    """Each site's compute seconds per inner step in a short DiLoCo run of the job
    whose rounds keep the sites in step (the sites of an emulated run share cores
    unevenly: the slowest one sets the pace of every round)."""
    raw = load_yaml(job_path.read_text())
    raw["train"] = {**(raw.get("train") or {}), "steps": steps, "sync_every": LOCKSTEP_EVERY}
    raw["train"].update(strategy="diloco", codec="none")
    raw.pop("tune", None)  # never the online controller
    with tempfile.TemporaryDirectory(prefix="isthmus-calibrate-") as folder:
        job = Path(folder) / "job.yaml"
        job.write_text(yaml.safe_dump(raw))
        out = Path(folder) / "run"
        done = subprocess.run(
            [sys.executable, "-m", "isthmus", "run", str(job), "--out", str(out)],
            capture_output=True,
            text=True,
            timeout=900,
            cwd=folder,
        )
        if done.returncode:
            raise RuntimeError(f"calibration run failed: {done.stderr[-1500:]}")
        if json.loads((out / "summary.json").read_text())["status"] != "finished":
            raise RuntimeError(f"calibration run did not finish: {done.stdout[-1500:]}")
        return _steady_site_step_seconds(out / "metrics.jsonl")


WARM_UP_STEPS = LOCKSTEP_EVERY
"""Steps left out at the start: the first round starts cold, the sites one by one."""


def _steady_site_step_seconds(metrics: Path) -> dict[str, float]:
    """Each site's mean compute seconds per step after the warm-up: one slow first
    step in a short run would otherwise move the figure by tens of percent."""
    from isthmus.deploy.run_records import read_records

    by_site: dict[str, list[float]] = {}
    for record in read_records(metrics):
        if record.get("kind") == "step":
            by_site.setdefault(record["site"], []).append(record["compute_s"])
    means = {}
    for site, cumulative in sorted(by_site.items()):
        steady = cumulative[WARM_UP_STEPS:]
        if len(steady) >= 2:
            means[site] = (steady[-1] - steady[0]) / (len(steady) - 1)
    if not means:
        raise RuntimeError("calibration run recorded too few steps")
    return means
