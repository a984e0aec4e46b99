"""Compute time of one inner step on this machine, measured at a job's concurrency.

In an emulated run the sites, the emulator, the launcher and the broker share
this machine's cores, so a step timed alone is faster than a step in the run
(timing only the training processes, at the job's concurrency, still came out
10% fast; docs/performance-model.md). The calibration is therefore a short
``isthmus run`` of the job itself, synchronising as the job does, at most
every :data:`LOCKSTEP_EVERY` steps, so that the sites stay in step (without
rounds they drift apart, and a site computing while another still starts up,
or after it ended, sees other contention than in a run) and so that its
compute runs beside the same exchanges as in the job: Sync's gradient buckets
go out during the backward pass, Streaming's fragments during the next inner
step, and on shared cores either slows the compute down (Sync's by 15-20%
here: docs/performance-model.md). Async becomes DiLoCo: its sites do not keep
in step. It reports each site's compute seconds per inner step, as the run's
own records count them, after the first round (the sites start cold and at
different moments), and how much that varies from step to step.
"""

from __future__ import annotations

import itertools
import json
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from isthmus.deploy.jobfile import load_yaml

LOCKSTEP_EVERY = 10
"""Most inner steps between the calibration run's synchronisations."""

WARM_UP_STEPS = LOCKSTEP_EVERY
"""Steps left out at the start: the first round starts cold, the sites one by one."""


@dataclass(frozen=True)
class Calibration:
    step_s_by_site: dict[str, float]
    """Each site's mean compute seconds per inner step (the sites of an emulated run
    share cores unevenly: the slowest one sets the pace of every round)."""
    jitter_s: float
    """The standard deviation of one site's compute per step, from step to step (the
    median over sites): every synchronisation waits for the last site to arrive."""

    @property
    def step_s(self) -> float:
        """A typical (the median) site's compute seconds per inner step."""
        return statistics.median(self.step_s_by_site.values())

    @property
    def slowest_step_s(self) -> float:
        return max(self.step_s_by_site.values())


def calibration_train(train: dict[str, Any]) -> dict[str, Any]:
    """The ``train:`` settings of the calibration run of a job with ``train``."""
    strategy = train.get("strategy", "diloco")
    sync_every = int(train.get("sync_every", 50))
    fragments = int(train.get("fragments", 2))
    changed: dict[str, Any] = {"codec": "none"}  # the codec is modelled as host work
    if strategy == "sync":
        changed["strategy"] = "sync"
    elif strategy == "streaming":
        # A fragment at most every LOCKSTEP_EVERY steps, as many fragments as the job.
        changed.update(strategy="streaming", sync_every=min(sync_every, LOCKSTEP_EVERY * fragments))
    else:
        changed.update(strategy="diloco", sync_every=min(sync_every, LOCKSTEP_EVERY))
    return {**train, **changed}


def calibrate(job_path: Path, *, steps: int = 50) -> Calibration:
    """Each site's compute seconds per inner step, and their variation, in a short run
    of the job that synchronises as it does (see the module's docstring)."""
    raw = load_yaml(job_path.read_text())
    raw["train"] = calibration_train({**(raw.get("train") or {}), "steps": steps})
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
        return steady_calibration(out / "metrics.jsonl")


def steady_calibration(metrics: Path, *, warm_up: int = WARM_UP_STEPS) -> Calibration:
    """Each site's compute per step after the warm-up (one slow first step in a short
    run would otherwise move the figure by tens of percent), and its variation."""
    from isthmus.deploy.run_records import read_records

    by_site: dict[str, list[tuple[int, float]]] = {}
    for record in read_records(metrics):
        if record.get("kind") == "step":
            by_site.setdefault(record["site"], []).append((record["step"], record["compute_s"]))
    means, spreads = {}, []
    for site, steps in sorted(by_site.items()):
        # compute_s is cumulative: a step's compute is the difference to the one before.
        cumulative = [seconds for _, seconds in sorted(steps)][warm_up:]
        if len(cumulative) >= 2:
            means[site] = (cumulative[-1] - cumulative[0]) / (len(cumulative) - 1)
        each = [b - a for a, b in itertools.pairwise(cumulative)]
        if len(each) >= 2:
            spreads.append(statistics.stdev(each))
    if not means:
        raise RuntimeError("calibration run recorded too few steps")
    return Calibration(means, statistics.median(spreads) if spreads else 0.0)
