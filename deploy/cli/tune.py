"""``isthmus tune``: pick the sync interval H, the codec and (streaming) fragments for a
job's links: the performance model proposes, short emulated trials confirm.

1. Compute time per inner step: ``--step-ms``, else a calibration run of the job
   (the same as ``isthmus sim --calibrate``).
2. The model's sweep over H (a 1-2-5 ladder within ``tune.min/max_sync_every``),
   the allowed codecs and fragments; its pick is the smallest H that reaches the
   target utilisation, with the most precise codec (:mod:`isthmus.sim.tuner`).
3. Trials: short runs of the pick and its neighbours (the next smaller and
   larger H, the next more precise codec), as many steps as the budget allows.
4. The choice: the smallest trial H whose *measured* utilisation reached the
   target. Printed as a table with a plot; ``--apply`` writes it into the job file.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from isthmus.deploy.usage import UsageError, accept_command, add_command
from isthmus.job.basics import to_json
from isthmus.job.file import Job, load_job
from isthmus.sim.perf_model import ScenarioError
from isthmus.sim.tuner import (
    Candidate,
    TuneError,
    TuneSettings,
    model_pick,
    neighbours,
    sweep,
    trial_choice,
)

DEFAULT_BUDGET_MINUTES = 10.0
MIN_TRIAL_ROUNDS = 2
"""A trial runs at least this many rounds of its H: one round alone starts cold."""
SYNC_TRIAL_STEPS = 20


def register(commands: Any) -> None:
    tune = add_command(
        commands,
        "tune",
        _tune,
        help="recommend sync_every, codec and fragments for a job's links: the performance "
        "model's pick, confirmed by short emulated trials",
    )
    tune.add_argument("job", metavar="JOB.yaml", help="the job file (its wan: links and train:)")
    # isthmus tune JOB -- python train.py: calibration and trials run the script.
    accept_command(tune)
    tune.add_argument(
        "--budget-minutes",
        type=float,
        default=DEFAULT_BUDGET_MINUTES,
        metavar="M",
        help=f"time for calibration and trials (default {DEFAULT_BUDGET_MINUTES:g}); "
        "0: the model's pick without trials",
    )
    tune.add_argument(
        "--apply", action="store_true", help="write the choice into the job file's train: keys"
    )
    tune.add_argument("--out", type=Path, metavar="DIR", help="where the trials and report go")
    tune.add_argument(
        "--step-ms", type=float, help="compute time of one inner step (skips the calibration)"
    )
    tune.add_argument("--trial-steps", type=int, metavar="N", help="steps per trial")
    tune.add_argument(
        "--target-utilization", type=float, metavar="U", help="overrides tune.target_utilization"
    )
    tune.add_argument(
        "--price-per-gb", type=float, metavar="USD", help="overrides tune.price_per_gb"
    )
    tune.add_argument("--json", action="store_true", help="print the result as JSON")


def _tune(args: argparse.Namespace) -> int:
    from isthmus.deploy.launch.run_dir import RunError, prepare_run_dir

    job_path = Path(args.job)
    job = load_job(job_path)
    settings = _settings(job, args)
    if not (args.budget_minutes >= 0 and math.isfinite(args.budget_minutes)):
        raise UsageError(f"--budget-minutes: must be >= 0, got {args.budget_minutes}")
    if args.trial_steps is not None and args.trial_steps < 1:
        raise UsageError(f"--trial-steps: must be >= 1, got {args.trial_steps}")
    started = time.monotonic()
    log = sys.stderr if args.json else sys.stdout
    command = getattr(args, "command", None)
    step_s, jitter_s, source, measured = _step_seconds(args, job_path, log)
    if command and measured is None:
        raise UsageError(
            "--step-ms: a script's parameter count comes from its calibration run; "
            "leave --step-ms out to calibrate on it"
        )
    from isthmus.deploy.cli.sim import job_scenario, range_note

    try:
        scenario = job_scenario(
            job_path,
            step_s,
            jitter_s,
            params=measured.parameters if command and measured else None,
            tokens_per_step=measured.tokens_per_step if command and measured else None,
            calibration=measured,
        )
        candidates = sweep(scenario, settings)
        pick, reaches = model_pick(candidates, settings.target_utilization)
    except ScenarioError as exc:
        raise UsageError(f"{job_path}: {exc}") from None
    notes = [] if reaches else [_unreachable(pick, settings)]
    if note := range_note(scenario):
        notes.append(note)
    out = args.out or Path("runs") / f"{job.name}-tune-{datetime.now(UTC):%Y%m%d-%H%M%S}"
    try:
        prepare_run_dir(out)
    except RunError as exc:
        raise UsageError(str(exc)) from None
    trials: list[Any] = []
    if args.budget_minutes > 0:
        budget_left = args.budget_minutes * 60 - (time.monotonic() - started)
        wanted = neighbours(pick, candidates)
        planned, steps = _plan(job, wanted, budget_left, args.trial_steps)
        if len(planned) < len(wanted):
            notes.append(
                f"the budget fits {len(planned)} trial(s) of {steps} steps; "
                "a larger --budget-minutes tries the neighbours too"
            )
        trials = _run_trials(job_path, planned, steps, out / "trials", log, command)
    finished = [t for t in trials if t.status == "finished"]
    if trials and not finished:
        raise UsageError(f"no trial finished; see {out / 'trials'} (each run's logs/)")
    if finished:
        choice = trial_choice(
            [(t.candidate, t.utilization) for t in finished], settings.target_utilization
        )
        notes.append(
            f"trials of {finished[0].steps} steps: their held-out losses rank convergence only "
            "roughly (the choice rests on measured utilisation)"
        )
    else:
        choice = pick
        notes.append("no trials (--budget-minutes 0): the model's pick, not measured")
    result = _result(job, scenario, settings, step_s, source, candidates, pick, choice, trials)
    result["calibrated"] = scenario.model
    result["command"] = command
    result["notes"] = notes
    _write(out, result)
    if args.apply:
        _apply(job_path, choice, log)
        result["applied"] = True
    if args.json:
        print(to_json(result, indent=2))
    else:
        from isthmus.deploy.tune.report import print_table

        print_table(result)
        print(f"report: {out / 'tune.md'}")
    return 0


def _settings(job: Job, args: argparse.Namespace) -> TuneSettings:
    changes = {}
    if args.target_utilization is not None:
        changes["target_utilization"] = args.target_utilization
    if args.price_per_gb is not None:
        changes["price_per_gb"] = args.price_per_gb
    try:
        return dataclasses.replace(job.tune, **changes)
    except TuneError as exc:
        raise UsageError(f"--{exc.field.replace('_', '-')}: {exc.reason}") from None


def _step_seconds(
    args: argparse.Namespace, job_path: Path, log: Any
) -> tuple[float, float, str, Any]:
    """Compute seconds per inner step, their variation from step to step, where they
    came from, and the calibration (None with ``--step-ms``): of the built-in loop,
    or of the script after ``--``."""
    if args.step_ms is not None:
        if not (args.step_ms > 0 and math.isfinite(args.step_ms)):
            raise UsageError(f"--step-ms: must be > 0, got {args.step_ms}")
        return args.step_ms / 1e3, 0.0, "--step-ms", None
    from isthmus.deploy.bench.calibrate import calibrate

    command = getattr(args, "command", None)
    what = f"the script {' '.join(command)}" if command else "the job"
    print(f"calibrating: a short run of {what}, synchronising as it does ...", file=log, flush=True)
    try:
        measured = calibrate(job_path, command=command)
    except RuntimeError as exc:
        raise UsageError(f"calibration failed: {exc}; or give --step-ms") from None
    return measured.step_s, measured.jitter_s, f"calibrated here on {measured.described()}", (
        measured
    )


def _unreachable(pick: Candidate, settings: TuneSettings) -> str:
    return (
        f"no allowed setting reaches {settings.target_utilization:.0%} per the model; the best "
        f"is {pick.label} at {pick.prediction.utilization:.0%} (raise tune.max_sync_every, "
        "allow smaller codecs, or lower the target)"
    )


def _plan(
    job: Job, candidates: list[Candidate], budget_s: float, trial_steps: int | None
) -> tuple[list[Candidate], int]:
    """The trials that fit the budget (the model's pick first) and their step count."""
    from isthmus.deploy.tune.trials import RUN_OVERHEAD_S

    def needed(c: Candidate) -> int:
        if c.prediction.strategy == "sync":
            return SYNC_TRIAL_STEPS
        return MIN_TRIAL_ROUNDS * c.sync_every

    # A neighbour that needs more steps than the whole job is not worth a trial.
    planned = [c for c in candidates if c is candidates[0] or needed(c) <= job.train.steps]
    while planned:
        slowest = max(c.prediction.step_s for c in planned)
        least = max(needed(c) for c in planned)
        if trial_steps is not None:
            steps = trial_steps
        else:
            per_trial = budget_s / len(planned) - RUN_OVERHEAD_S
            steps = min(job.train.steps, int(per_trial / slowest)) if per_trial > 0 else 0
        if steps >= least or (trial_steps is not None):
            return planned, max(steps, 1)
        planned.pop()
    first = candidates[0]
    minutes = (needed(first) * first.prediction.step_s + RUN_OVERHEAD_S) / 60
    raise UsageError(
        f"--budget-minutes: too small for one trial of {first.label} ({needed(first)} steps, "
        f"about {minutes:.1f} min after calibration); give more, or 0 for the model's pick alone"
    )


def _run_trials(
    job_path: Path,
    planned: list[Candidate],
    steps: int,
    folder: Path,
    log: Any,
    command: list[str] | None = None,
) -> list[Any]:
    from isthmus.deploy.launch.run_dir import RunError
    from isthmus.deploy.launch.warm_start import template_for_runs
    from isthmus.deploy.tune.trials import TrialProgress, run_trial

    results = []
    # Every trial forks its ranks from one warm template: a trial's start is then
    # not a fresh import of torch (a few seconds of each short trial's budget).
    with (
        TrialProgress(steps * len(planned), out=log) as progress,
        template_for_runs(folder) as template,
    ):
        for index, candidate in enumerate(planned, 1):
            progress.trial_started(index, len(planned), candidate, steps)
            run_dir = folder / candidate.label.replace(" ", "-").replace("=", "")
            try:
                result = run_trial(
                    job_path, candidate, steps, run_dir, progress.update, template, command
                )
            except RunError as exc:
                raise UsageError(str(exc)) from None
            progress.trial_ended(result)
            results.append(result)
            if result.status == "interrupted":
                break
    return results


def _result(
    job: Job,
    scenario: Any,
    settings: TuneSettings,
    step_s: float,
    source: str,
    candidates: list[Candidate],
    pick: Candidate,
    choice: Candidate,
    trials: list[Any],
) -> dict[str, Any]:
    job_tokens = scenario.tokens_per_step * job.train.steps
    by_label = {t.candidate.label: t for t in trials}
    shown = [t.candidate for t in trials] or _model_rows(candidates, pick)
    rows = []
    for c in shown:
        trial = by_label.get(c.label)
        per_token = trial.wan_bytes_per_token if trial else c.prediction.wan_bytes_per_token
        row = {
            "label": c.label,
            "settings": c.settings(),
            "predicted_utilization": c.prediction.utilization,
            "predicted_step_s": c.prediction.step_s,
            "wan_bytes_per_token": per_token,
            "egress_cost": per_token * job_tokens / 1e9 * settings.price_per_gb,
        }
        if trial is not None:
            row.update({k: v for k, v in trial.to_dict().items() if k not in row})
        rows.append(row)
    return {
        "job": job.name,
        "strategy": job.train.strategy,
        "target_utilization": settings.target_utilization,
        "price_per_gb": settings.price_per_gb,
        "job_tokens": job_tokens,
        "step_s": step_s,
        "step_source": source,
        "model_pick": {**_brief(pick), "fragments": pick.fragments},
        "choice": _brief(choice),
        "rows": rows,
        "sweep": [
            {
                "sync_every": c.sync_every,
                "codec": c.codec,
                "fragments": c.fragments,
                "utilization": c.prediction.utilization,
                "wan_bytes_per_token": c.prediction.wan_bytes_per_token,
            }
            for c in candidates
        ],
    }


def _model_rows(candidates: list[Candidate], pick: Candidate) -> list[Candidate]:
    """Without trials: the pick and, per codec, the model's best at the pick's H."""
    same_h = [c for c in candidates if c.sync_every == pick.sync_every and c is not pick]
    best: dict[str, Candidate] = {}
    for c in same_h:
        if c.codec not in best or c.prediction.utilization > best[c.codec].prediction.utilization:
            best[c.codec] = c
    return [pick, *best.values()]


def _brief(c: Candidate) -> dict[str, Any]:
    return {"label": c.label, "settings": c.settings()}


def _write(out: Path, result: dict[str, Any]) -> None:
    from isthmus.deploy.tune.report import markdown, plot
    from isthmus.training.records import write_json_atomic

    write_json_atomic(out / "tune.json", result)
    plot(result, out / "tune.png")
    (out / "tune.md").write_text(markdown(result))


def _apply(job_path: Path, choice: Candidate, log: Any) -> None:
    from isthmus.job.file.edit import JobEditError, set_train_keys

    try:
        set_train_keys(job_path, choice.settings())
    except JobEditError as exc:
        raise UsageError(f"--apply: {job_path}: {exc}") from None
    keys = ", ".join(f"{k}: {v}" for k, v in choice.settings().items())
    print(f"applied to {job_path}: train: {{{keys}}}", file=log, flush=True)
