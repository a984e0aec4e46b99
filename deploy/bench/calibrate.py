"""Compute time of one inner step on this machine, measured at a job's concurrency.

In an emulated run the sites, the emulator, the launcher and the broker share
this machine's cores, so a step timed alone is faster than a step in the run
(timing only the training processes, at the job's concurrency, still came out
10% fast; docs/performance-model.md). The calibration is therefore a short
``isthmus run`` of the job itself: its strategy, its synchronisation interval
(at most :data:`ROUND_CAP` steps) and its links, only without a lossy codec
(the model costs codecs as host work). So its compute runs beside the same
exchanges as in the job: Sync's gradient buckets go out during the backward
pass, Streaming's fragments and Async's rounds during the next inner steps,
and on shared cores either slows the compute down (Sync's by 15-20% here). And
it keeps the job's duty cycle: where sites wait long for a slow link, they
reach its end at different moments and compute beside fewer others, so their
steps are faster than where they compute almost all the time (the same 3-site
job computed 20 ms steps with a round every 10 steps and 29 ms every 25 on
two cores; a calibration synchronising every 10 steps had under-predicted
the runs of every job that synchronises less often, by up to 40%). It reports
each site's compute seconds per inner step, as the run's own records count
them, after the first round (the sites start cold and at different moments),
and how much that varies from step to step.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from isthmus.job.file import load_yaml
from isthmus.job.settings import TrainSettings

ROUND_CAP = 50
"""Most inner steps between the calibration run's synchronisations (Streaming's:
between its fragments' exchanges): a job that synchronises less often is
calibrated at this interval, where its sites compute nearly all the time already,
to keep the calibration short."""

WARM_UP_STEPS = 10
"""Steps left out at the start at least: the first round starts cold, the sites one
by one (:func:`calibration_steps` leaves out a whole first round)."""

MIN_STEPS = 50
"""Fewest steps of a calibration run: enough rounds to see how late the last site is."""


@dataclass(frozen=True)
class Calibration:
    step_s_by_site: dict[str, float]
    """Each site's mean compute seconds per inner step (the sites of an emulated run
    share cores unevenly: the slowest one sets the pace of every round)."""
    jitter_s: float
    """How much a site's compute per step varies, as the model uses it: the standard
    deviation of independent steps that would make the last site reach the
    calibration's synchronisations as late (beyond its mean pace) as it did."""
    outside_s_by_site: dict[str, float] = dataclasses.field(default_factory=dict)
    """Each site's wall seconds, per exchange of the whole model, that are neither
    compute nor waiting on the strategy: what the model cannot see. A check, not a
    model input: the validation found 0.1-0.5 s per exchange on 2-rank sites while
    their per-step collective was timed outside compute, and 13-43 ms (1-2 ms a
    step of bookkeeping) once it counted inside (docs/performance-model.md)."""

    parameters: int | None = None
    """The model's parameters as the strategy synchronised them (the run's
    ``summary.json``: the built-in model's, or the script's own)."""
    tokens_per_step: float | None = None
    """Tokens all sites together trained on per inner step, as the run counted them."""
    model: str | None = None
    """What trained: the built-in model's size, or what the script's sites said
    (``site.describe(model=...)``, else its class)."""
    command: list[str] | None = None
    """The script the calibration ran (None: the built-in loop)."""

    def described(self) -> str:
        """What was calibrated, as ``tune`` and ``sim`` print it."""
        what = (
            f"the script `{' '.join(self.command)}`" if self.command else "the built-in loop"
        )
        model = f", model {self.model}" if self.model else ""
        count = f", {self.parameters:,} parameters" if self.parameters else ""
        return f"{what}{model}{count}"

    @property
    def in_site_s(self) -> float:
        """The largest of :attr:`outside_s_by_site`: what the worst site leaves unseen."""
        return max(self.outside_s_by_site.values(), default=0.0)

    @property
    def step_s(self) -> float:
        """A typical (the median) site's compute seconds per inner step."""
        return statistics.median(self.step_s_by_site.values())

    @property
    def slowest_step_s(self) -> float:
        return max(self.step_s_by_site.values())

    @property
    def runner_up_step_s(self) -> float:
        return second_slowest(self.step_s_by_site.values())


def second_slowest(step_s: Iterable[float]) -> float:
    """The second largest of the sites' compute per step (the one site's, if alone)."""
    ordered = sorted(step_s)
    return ordered[-2] if len(ordered) > 1 else ordered[-1]


def steps_between_syncs(train: dict[str, Any]) -> int:
    """Inner steps between the synchronisations of a run with ``train`` settings (as
    :func:`calibration_train` gives them)."""
    if train["strategy"] == "sync":
        return 1
    if train["strategy"] == "streaming":
        return max(1, int(train["sync_every"]) // int(train.get("fragments", 2)))
    return int(train["sync_every"])


def calibration_train(train: dict[str, Any]) -> dict[str, Any]:
    """The ``train:`` settings of the calibration run of a job with ``train`` (its
    ``steps`` and warm-up from :func:`calibration_steps`)."""
    defaults = TrainSettings()
    strategy = train.get("strategy", defaults.strategy)
    # The codec is modelled as host work; the strategy and interval written out, so
    # that steps_between_syncs reads them where the job left them to the defaults.
    changed: dict[str, Any] = {"codec": "none", "strategy": strategy}
    if strategy == "streaming":
        # Its sites meet at every fragment: cap the fragments' interval, not the round,
        # and keep each exchange's overlap within it.
        fragments = int(train.get("fragments", defaults.fragments))
        every = min(int(train.get("sync_every", defaults.sync_every)), ROUND_CAP * fragments)
        overlap = int(train.get("overlap_steps", defaults.overlap_steps))
        changed.update(sync_every=every, overlap_steps=min(overlap, every // fragments))
    elif strategy != "sync":
        every = int(train.get("sync_every", defaults.sync_every))
        changed["sync_every"] = min(every, ROUND_CAP)
    calibration = {**train, **changed}
    calibration.pop("compressor", None)  # the sparse codec's settings, with its codec
    return calibration


def calibration_steps(train: dict[str, Any]) -> tuple[int, int]:
    """Steps of the calibration run with ``train`` settings (as :func:`calibration_train`
    gives them), and the first of them left out: a whole first round (at least
    :data:`WARM_UP_STEPS`), then three rounds measured (at least :data:`MIN_STEPS`
    steps in all)."""
    every = steps_between_syncs(train)
    warm_up = max(WARM_UP_STEPS, every)
    return max(MIN_STEPS, warm_up + 3 * every), warm_up


def calibrate(
    job_path: Path, *, keep: Path | None = None, command: list[str] | None = None
) -> Calibration:
    """Each site's compute seconds per inner step, and their variation, in a short run
    of the job that synchronises as it does (see the module's docstring); ``keep``:
    a folder for the run (else a temporary one). ``command``: the user's script, run
    as ``isthmus run JOB -- CMD`` runs it (else the built-in loop). Raises
    RuntimeError with the run's own one-line error when it fails."""
    raw = load_yaml(job_path.read_text())
    train = calibration_train(raw.get("train") or {})
    steps, warm_up = calibration_steps(train)
    raw["train"] = {**train, "steps": steps}
    raw.pop("tune", None)  # never the online controller
    # A failed run's folder stays: its error names a log in it.
    folder = keep or Path(tempfile.mkdtemp(prefix="isthmus-calibrate-"))
    measured = _calibration_run(folder, raw, warm_up, command)
    if keep is None:
        shutil.rmtree(folder, ignore_errors=True)
    return measured


def _calibration_run(
    folder: Path, raw: dict[str, Any], warm_up: int, command: list[str] | None
) -> Calibration:
    """The calibration run in ``folder``: the job as ``raw`` says, of the built-in loop
    or of ``command``; its steady figures and what trained."""
    folder.mkdir(parents=True, exist_ok=True)
    job = folder / "job.yaml"
    job.write_text(yaml.safe_dump(raw))
    out = folder / "run"
    run = [sys.executable, "-m", "isthmus", "run", str(job), "--out", str(out)]
    done = subprocess.run(
        [*run, "--no-report", *(["--", *command] if command else [])],
        capture_output=True,
        text=True,
        timeout=900,
        # The script's relative paths are the caller's, as under `isthmus run`.
        cwd=None if command else str(folder),
    )
    if done.returncode:
        raise RuntimeError(f"the calibration run failed: {_error_line(done.stderr)}")
    summary = json.loads((out / "summary.json").read_text())
    if summary["status"] != "finished":
        raise RuntimeError(f"the calibration run did not finish: {done.stdout[-1500:]}")
    measured = steady_calibration(
        out / "metrics.jsonl",
        every=steps_between_syncs(raw["train"]),
        warm_up=warm_up,
        model_share=model_share(raw["train"]),
    )
    return dataclasses.replace(measured, command=command, **_what_trained(summary))


def _error_line(stderr: str) -> str:
    """The run's own error (its last ``error:`` line), else its last line."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if "error:" in line]
    return (errors or lines or ["no output"])[-1]


def _what_trained(summary: dict[str, Any]) -> dict[str, Any]:
    """The model's name and parameters, and the tokens per inner step of all sites, from
    a calibration run's summary."""
    sites = [s for s in summary["sites"].values() if s.get("inner_steps")]
    ran = next((s["ran"] for s in sites if s.get("ran")), {})
    tokens = sum((s.get("tokens") or 0) / s["inner_steps"] for s in sites)
    return {
        "parameters": ran.get("parameters"),
        "tokens_per_step": tokens or None,
        "model": summary.get("model"),
    }


def model_share(train: dict[str, Any]) -> float:
    """The share of the model one synchronisation of a run with ``train`` exchanges."""
    if train.get("strategy") == "streaming":
        return 1.0 / int(train.get("fragments", 2))
    return 1.0


def steady_calibration(
    metrics: Path, *, every: int, warm_up: int = WARM_UP_STEPS, model_share: float = 1.0
) -> Calibration:
    """Each site's compute per step after the warm-up (one slow first step in a short
    run would otherwise move the figure by tens of percent), and its variation: at
    each synchronisation (``every`` steps), how far the last site's compute since
    the one before, beyond its own mean pace, lies past the average site's. That
    lateness, over the model's sigma sqrt(every) e(S), is the sigma that reproduces
    it. The sites' steps are not what the model assumes, independent: on shared
    cores a step that lost its core is often followed by one that gets it, and
    steps slowed at every site alike (a round's own work) keep no one waiting;
    the standard deviation of single steps overstated the lateness 1.6x in a
    4-site DiLoCo run here."""
    from isthmus.sim.perf_model import expected_largest_normal
    from isthmus.training.records import read_records

    by_site: dict[str, dict[int, float]] = {}
    written: dict[str, dict[int, float]] = {}
    blocked: dict[str, list[tuple[float, float]]] = {}
    for record in read_records(metrics):
        if record.get("kind") == "step":
            by_site.setdefault(record["site"], {0: 0.0})[record["step"]] = record["compute_s"]
            written.setdefault(record["site"], {})[record["step"]] = record["t"]
        elif record.get("kind") == "blocked":
            started = record.get("started", record["t"])
            blocked.setdefault(record["site"], []).append((started, record["seconds"]))
    last = min((max(steps) for steps in by_site.values()), default=0)
    if last - warm_up < 2 or any(warm_up not in s or last not in s for s in by_site.values()):
        raise RuntimeError("calibration run recorded too few steps")
    # compute_s is cumulative: the compute of steps (a, b] is the difference.
    means = {
        site: (steps[last] - steps[warm_up]) / (last - warm_up)
        for site, steps in sorted(by_site.items())
    }
    lateness = []
    first = -(-warm_up // every) * every  # the first synchronisation after the warm-up
    for start in range(first, last - every + 1, every):
        end = start + every
        if any(start not in steps or end not in steps for steps in by_site.values()):
            continue  # a step without its record (a site restarted): no comparison
        beyond = [
            steps[end] - steps[start] - every * means[site] for site, steps in by_site.items()
        ]
        lateness.append(max(beyond) - statistics.fmean(beyond))
    spread = expected_largest_normal(len(by_site)) * math.sqrt(every)
    jitter = statistics.fmean(lateness) / spread if lateness and spread else 0.0
    # Between the records of the warm-up's last step and the last step: the wall
    # time that is neither compute nor blocked on the strategy, per synchronisation.
    syncs = (last - warm_up) // every
    outside = {}
    for site, times in written.items():
        if syncs < 1 or warm_up not in times or last not in times:
            continue
        begin, end = times[warm_up], times[last]
        waited = sum(
            seconds for started, seconds in blocked.get(site, []) if begin <= started < end
        )
        compute = by_site[site][last] - by_site[site][warm_up]
        outside[site] = max(0.0, end - begin - compute - waited) / syncs / model_share
    return Calibration(means, jitter, dict(sorted(outside.items())))


MACHINE_SIZE_MIB = 32
"""The all-reduce that measures the emulating machine's rate: large enough that its
rounds are the machine's bytes, not its latencies."""


def machine_rate(job_path: Path, *, repeats: int = 3) -> tuple[float, int]:
    """The data-plane bytes per second this machine moves with the job's sites (one
    process each: the site processes of the data plane; a multi-rank site's other
    ranks compute beside them in a run, which this leaves out), and how many: the
    engine's direct all-reduce of :data:`MACHINE_SIZE_MIB` MiB among them over
    unbounded links (no latency, 100 Gbit/s), its bytes over its median round. The
    model bounds every all-reduce phase of the emulated job by it
    (:mod:`isthmus.sim.cost`): with many sites on few cores the phases on fast links
    take the machine's time, not the link's (nine sites: 0.27 s against a link bound
    of 0.09 s)."""
    from isthmus.deploy.bench.allreduce import run_allreduce_bench
    from isthmus.job.file import parse_job

    raw = load_yaml(job_path.read_text())
    unbounded = {
        "name": f"{raw.get('name', 'job')}-machine",
        "sites": [{"name": site["name"]} for site in raw["sites"]],
        "wan": {"default": {"rtt_ms": 0, "bandwidth_mbit": 100_000}},
    }
    job = parse_job(yaml.safe_dump(unbounded), source=f"{job_path} (links unbounded)")
    measured = run_allreduce_bench(
        sites=len(job.sites),
        size_mib=MACHINE_SIZE_MIB,
        rtt_ms=None,
        bandwidth_mbit=None,
        codec="none",
        repeats=repeats,
        algorithm="direct",
        verbose=False,
        job=job,
    )
    return measured["data_plane_bytes_per_round"] / measured["median_seconds"], len(job.sites)
