"""Compute time of one inner step on this machine, measured at a job's concurrency.

In an emulated run the sites, the emulator, the launcher and the broker share
this machine's cores, so a step timed alone is faster than a step in the run
(timing only the training processes, at the job's concurrency, still came out
10% fast; docs/performance-model.md). The calibration is therefore a short
``isthmus run`` of the job itself whose sites do not synchronise until the
end: the median over sites of compute seconds per inner step, as the run's own
records count them.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml


def run_step_seconds(job_path: Path, *, steps: int = 40) -> float:
    """Median compute seconds per inner step in a short run of the job with no
    synchronisation before its end (so every site computes all the time)."""
    raw = yaml.safe_load(job_path.read_text())
    raw["train"] = {**(raw.get("train") or {}), "steps": steps, "sync_every": steps * 100}
    raw["train"]["strategy"] = "diloco"
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
        sites = json.loads((out / "summary.json").read_text())["sites"].values()
        return statistics.median(s["compute_seconds"] / s["inner_steps"] for s in sites)
