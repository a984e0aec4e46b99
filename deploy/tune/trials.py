"""``isthmus tune``'s trials: short emulated runs of candidate settings, measured.

Each trial is an ordinary ``isthmus run`` of the job (same sites, links, model
and data) with the candidate's ``train:`` keys and fewer steps, in its own
directory under the tuning directory, so its records and summary are there to
read like any run's. What a trial yields is what the tuner's table shows:
measured utilisation and step time, WAN bytes per token, and the held-out loss
after the trial's tokens.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from isthmus.deploy.launch.run_dir import prepare_run_dir, resolve_job
from isthmus.deploy.launch.run_state import RunState
from isthmus.sim.tuner import Candidate
from isthmus.training.records import read_records

RUN_OVERHEAD_S = 12.0
"""Seconds a short run spends outside its steps here: starting the emulator, the
broker and the site processes, building the model, the final evaluation and
saving it (measured: 10-13 s for the tiny model on the 2-core machine)."""


@dataclass
class TrialResult:
    candidate: Candidate
    run_dir: Path
    status: str
    steps: int
    wall_seconds: float
    utilization: float
    """Measured: the mean over sites of compute seconds / wall seconds, held-out
    evaluations left out (as the model predicts it)."""
    step_s: float
    """Measured wall seconds per inner step, evaluations left out (median over sites)."""
    wan_bytes_per_token: float
    eval_loss: float | None
    """Held-out loss of the trial's final model."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "label": self.candidate.label,
            "settings": self.candidate.settings(),
            "run_dir": str(self.run_dir),
            "status": self.status,
            "steps": self.steps,
            "wall_seconds": self.wall_seconds,
            "measured_utilization": self.utilization,
            "measured_step_s": self.step_s,
            "wan_bytes_per_token": self.wan_bytes_per_token,
            "eval_loss": self.eval_loss,
        }


def run_trial(
    job_path: Path,
    candidate: Candidate,
    steps: int,
    run_dir: Path,
    on_update: Callable[[RunState], None] | None = None,
    template: Any = None,
    command: list[str] | None = None,
) -> TrialResult:
    """One short run of the job with the candidate's settings; never the online
    controller (the trial measures the setting itself). ``template``: the warm rank
    template the trials share (the built-in loop's); ``command``: the user's script,
    run instead of the built-in loop."""
    from isthmus.deploy.launch.execute import execute_run

    job, raw = resolve_job(
        job_path,
        steps=steps,
        train=candidate.settings(),
        tune={"online": False},
    )
    prepare_run_dir(run_dir)
    summary = execute_run(
        job,
        raw,
        run_dir,
        on_update=on_update,
        template=template if command is None else None,
        command=command,
    )
    return result_from_summary(candidate, run_dir, summary)


def result_from_summary(
    candidate: Candidate, run_dir: Path, summary: dict[str, Any]
) -> TrialResult:
    from isthmus.deploy.launch.summary import training_figures

    sites = list(summary["sites"].values())
    tokens = sum(s.get("tokens") or 0 for s in sites)
    figures = list(training_figures(run_dir, summary).values())
    losses = [s["eval_loss"] for s in sites if s.get("eval_loss") is not None]
    return TrialResult(
        candidate=candidate,
        run_dir=run_dir,
        status=summary["status"],
        steps=summary["settings"]["steps"],
        wall_seconds=summary["wall_seconds"],
        utilization=statistics.fmean(f["utilization"] for f in figures) if figures else 0.0,
        step_s=statistics.median(f["step_s"] for f in figures) if figures else float("nan"),
        wan_bytes_per_token=summary["wan_bytes"] / tokens if tokens else float("nan"),
        eval_loss=losses[0] if losses else None,
    )


def loss_curve(run_dir: Path, smoothing: int = 20) -> list[tuple[float, float]]:
    """(seconds since the run's first step record, training loss) per inner step: the
    mean over sites of each step's loss, as a running mean over ``smoothing`` steps
    (a DiLoCo round resets the local model, so single steps jump)."""
    by_step: dict[int, list[tuple[float, float]]] = {}
    for record in read_records(run_dir / "metrics.jsonl"):
        if record.get("kind") == "step" and record.get("loss") is not None:
            by_step.setdefault(record["step"], []).append((record["t"], record["loss"]))
    if not by_step:
        return []
    start = min(t for points in by_step.values() for t, _ in points)
    curve, window = [], []
    for step in sorted(by_step):
        points = by_step[step]
        window.append(statistics.fmean(loss for _, loss in points))
        window = window[-smoothing:]
        curve.append((max(t for t, _ in points) - start, statistics.fmean(window)))
    return curve


def time_to_loss(curve: list[tuple[float, float]], target: float) -> float | None:
    """Seconds until the smoothed loss first reaches ``target``; None if it never does."""
    for seconds, loss in curve:
        if loss <= target:
            return seconds
    return None


class TrialProgress:
    """One progress bar over every trial's steps in a terminal; a line per trial
    elsewhere."""

    def __init__(self, total_steps: int, out: IO[str] | None = None) -> None:
        self.out = out or sys.stdout
        self.total = total_steps
        self.done_before = 0
        self.started = time.monotonic()
        self._bar: Any = None
        self._task: Any = None
        if self.out.isatty():
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeRemainingColumn,
            )

            self._bar = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeRemainingColumn(),
            )
            self._task = self._bar.add_task("trials", total=total_steps)

    def __enter__(self) -> TrialProgress:
        if self._bar is not None:
            self._bar.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.stop()

    def trial_started(self, index: int, count: int, candidate: Candidate, steps: int) -> None:
        text = f"trial {index}/{count}: {candidate.label}, {steps} steps"
        if self._bar is not None:
            self._bar.update(self._task, description=text)
        else:
            print(f"[{time.monotonic() - self.started:6.0f}s] {text}", file=self.out, flush=True)

    def update(self, state: RunState) -> None:
        if self._bar is None:
            return
        done = min(s.step for s in state.sites.values())
        self._bar.update(self._task, completed=self.done_before + done)

    def trial_ended(self, result: TrialResult) -> None:
        self.done_before += result.steps
        if self._bar is not None:
            self._bar.update(self._task, completed=self.done_before)
            return
        loss = f"{result.eval_loss:.3f}" if result.eval_loss is not None else "-"
        print(
            f"[{time.monotonic() - self.started:6.0f}s]   {result.status}: utilisation "
            f"{result.utilization:.0%}, {result.step_s * 1e3:.0f} ms/step, held-out loss {loss}",
            file=self.out,
            flush=True,
        )
