"""``isthmus run``, ``isthmus eval`` and ``isthmus report``: the main job and what follows it."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path
from typing import Any

from isthmus.deploy.usage import UsageError, accept_command, add_command
from isthmus.job.basics import FieldError, to_json
from isthmus.job.settings import STRATEGIES

EXIT_CODES = {"finished": 0, "failed": 1, "interrupted": 130}
JOIN_TIMEOUT_S = 300.0  # isthmus.deploy.launch.launcher's, not imported: --help stays light


def register(commands: Any) -> None:
    run = add_command(
        commands,
        "run",
        _run,
        help="train a job's sites on this machine through the emulated WAN, with live "
        "progress, summary.json and a report",
        description="Train a job's sites on this machine through the emulated WAN, with "
        "live progress, summary.json and a report. Every rank of every site runs CMD "
        "(your training script, which calls isthmus.join()), or Isthmus's built-in "
        "training loop without -- CMD.",
    )
    run.usage = (
        "%(prog)s [options] JOB.yaml [-- CMD [ARGS...]]\n"
        "       %(prog)s [options] --resume RUN_DIR [-- CMD [ARGS...]]"
    )
    run.epilog = (
        "-- CMD [ARGS...]: the command every rank runs, e.g. `isthmus run job.yaml -- "
        "python train.py --lr 3e-4`; it learns its job, site and rank from the "
        "environment (ISTHMUS_JOB, ISTHMUS_SITE, RANK, ...; see docs/run.md)."
    )
    accept_command(run)
    run.add_argument("job", metavar="JOB.yaml", nargs="?", help="the job file")
    run.add_argument(
        "--resume",
        metavar="RUN_DIR",
        type=Path,
        help="go on with a stopped run from its sites' newest common checkpoint "
        "(train.checkpoint_every), with the run's own job.yaml",
    )
    run.add_argument(
        "--out",
        metavar="DIR",
        type=Path,
        help="the run directory (default: runs/JOB-STRATEGY-TIME); must not exist or be empty. "
        "With --compare, one sub-directory per strategy",
    )
    run.add_argument(
        "--strategy", choices=STRATEGIES, help="overrides the job file's train.strategy"
    )
    run.add_argument(
        "--steps", type=int, metavar="N", help="inner steps per site; overrides train.steps"
    )
    run.add_argument(
        "--restart-lost",
        action="store_true",
        help="start a site whose processes die again (as its operator would), so it "
        "rejoins the run (2 sites or more)",
    )
    run.add_argument(
        "--compare",
        metavar="S1,S2,...",
        help=f"run the job once per strategy ({','.join(STRATEGIES)}) with the same data and "
        "tokens, and write one comparison report",
    )
    run.add_argument(
        "--no-report",
        dest="report",
        action="store_false",
        help="write no report.md and plots (scripted runs, sweeps); `isthmus report RUN_DIR` "
        "writes them later from the run's files. With --compare, the comparison is still "
        "written, without its plot",
    )
    run.add_argument(
        "--join-timeout",
        type=float,
        metavar="SECONDS",
        default=JOIN_TIMEOUT_S,
        help="a site whose command has not called isthmus.join() this long after it "
        f"started has failed (default {JOIN_TIMEOUT_S:g}); raise it for a script that "
        "does much before it joins",
    )
    evaluate = add_command(
        commands,
        "eval",
        _eval,
        help="evaluate a run's final model (model.safetensors) on the held-out split",
    )
    evaluate.add_argument(
        "run_dir",
        metavar="RUN_DIR",
        type=Path,
        help="a finished run's directory (isthmus run --out)",
    )
    report = add_command(
        commands, "report", _report, help="write a run's report.md and plots again from its files"
    )
    report.add_argument(
        "run_dir", metavar="RUN_DIR", type=Path, help="a run's directory (isthmus run --out)"
    )


def _run(args: argparse.Namespace) -> int:
    _check_command(args)  # before the imports below, which load torch
    from isthmus.deploy.launch.run_dir import RunError, default_run_dir, resolve_job

    if args.resume is not None:
        return _resume(args)
    if args.job is None:
        raise UsageError("JOB.yaml: name the job file to run (or --resume RUN_DIR)")
    if args.steps is not None and args.steps < 1:
        raise UsageError(f"--steps: must be an integer >= 1, got {args.steps}")
    if args.compare:
        if args.strategy:
            raise UsageError("--compare runs every strategy it lists; drop --strategy")
        return _compare(args)
    try:
        job, raw = resolve_job(Path(args.job), strategy=args.strategy, steps=args.steps)
        run_dir = args.out or default_run_dir(job, job.train.strategy)
        summary = run_job(job, raw, run_dir, report=args.report, **_launch_options(args))
    except RunError as exc:
        raise UsageError(str(exc)) from None
    return EXIT_CODES[summary["status"]]


def _check_command(args: argparse.Namespace) -> None:
    command = getattr(args, "command", None)  # None: parsed without accept_command
    if command is not None and not command:
        raise UsageError("--: name the command every rank runs after it, e.g. -- python train.py")
    if not args.join_timeout > 0:
        raise UsageError(f"--join-timeout: must be > 0 seconds, got {args.join_timeout:g}")


def _launch_options(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "restart_lost": args.restart_lost,
        "command": getattr(args, "command", None),
        "join_timeout_s": args.join_timeout,
    }


def _resume(args: argparse.Namespace) -> int:
    from isthmus.deploy.launch.run_dir import RunError, resume_point, saved_command

    if args.job is not None or args.compare or args.strategy or args.steps or args.out:
        raise UsageError(
            "--resume goes on with the run as it was started (its own job.yaml and "
            "directory); drop JOB.yaml, --out, --strategy, --steps and --compare"
        )
    try:
        job, raw, round = resume_point(args.resume)
        options = _launch_options(args)
        if options["command"] is None:  # the run's own, unless a new one is given
            options["command"] = saved_command(args.resume)
        summary = run_job(job, raw, args.resume, resume_round=round, report=args.report, **options)
    except RunError as exc:
        raise UsageError(str(exc)) from None
    return EXIT_CODES[summary["status"]]


def run_job(
    job: Any,
    raw: dict[str, Any],
    run_dir: Path,
    *,
    resume_round: int | None = None,
    restart_lost: bool = False,
    command: list[str] | None = None,
    join_timeout_s: float = JOIN_TIMEOUT_S,
    report: bool = True,
    template: Any = None,
) -> dict[str, Any]:
    """One run, start to report; prints progress and where the report is.
    ``resume_round``: go on with a stopped run from that round's checkpoints.
    ``restart_lost``: start a lost site again, so it rejoins. ``command``: what
    every rank runs (None: the built-in loop), kept in the run directory for
    ``--resume``. ``join_timeout_s``: see ``--join-timeout``. ``report``: write
    report.md and its plots (about 1.5 CPU-seconds, most of it matplotlib).
    ``template``: a warm rank template shared with other runs (``--compare``)."""
    from isthmus.deploy.launch.execute import execute_run
    from isthmus.deploy.launch.progress import progress_for
    from isthmus.deploy.launch.report import write_report
    from isthmus.deploy.launch.run_dir import prepare_run_dir, save_command
    from isthmus.job.exposure import insecure_warning

    placement = _gpu_placement(job)  # refused before the run directory is made
    if resume_round is None:
        prepare_run_dir(run_dir)
        what = "run"
    else:
        what = f"resuming after round {resume_round}:"
    save_command(run_dir, command)
    runs = f", each rank runs {shlex.join(command)}" if command else ""
    print(
        f"{what} {job.name}: {len(job.sites)} sites, {job.train.strategy}, "
        f"{job.train.steps} steps{runs} -> {run_dir}",
        flush=True,
    )
    warning = insecure_warning(job)
    if warning:
        print(f"warning: {warning}", file=sys.stderr, flush=True)
    connections = _connections_note(job)
    if connections:
        print(connections, flush=True)
    if placement:
        from isthmus.intra.devices import describe_gpu_map

        print(describe_gpu_map(placement), flush=True)
    progress = progress_for(sys.stdout)
    with progress:
        summary = execute_run(
            job,
            raw,
            run_dir,
            on_update=progress.update,
            resume_round=resume_round,
            restart_lost=restart_lost,
            command=command,
            join_timeout_s=join_timeout_s,
            template=template,
        )
    _print_outcome(summary)
    if report:
        print(f"report: {write_report(run_dir)}", flush=True)
    else:
        print(f"report: not written (--no-report); isthmus report {run_dir} writes it", flush=True)
    return summary


def _connections_note(job: Any) -> str:
    """A line when some site opens several TCP connections to each peer (a long fat
    link, or the job says so): what a user timing the run would want to know."""
    from isthmus.inter.transport import connections_of

    counts = {site.name: connections_of(job, site.name) for site in job.sites}
    several = {name: n for name, n in counts.items() if n > 1}
    if not several:
        return ""
    why = (
        "the links' bandwidth x RTT is more than one TCP window carries"
        if job.train.connections_per_peer == "auto"
        else "train.connections_per_peer"
    )
    each = ", ".join(f"{name} {n}" for name, n in several.items())
    return f"TCP connections to each peer: {each} ({why})"


def _gpu_placement(job: Any) -> dict[str, list[int]]:
    """Which GPUs each site's ranks use on this machine (empty on the CPU); a job
    this machine cannot place is refused before anything starts."""
    from isthmus.intra.devices import emulated_gpu_map

    try:
        return emulated_gpu_map([(s.name, s.ranks) for s in job.sites], job.train.device)
    except FieldError as exc:
        raise UsageError(f"train.{exc}") from None


def _print_outcome(summary: dict[str, Any]) -> None:
    for name, site in summary["sites"].items():
        if site.get("reason"):
            print(f"site {name} {site['status']}: {site['reason']}", file=sys.stderr)
    # Sites that left on purpose keep the model they had when they left.
    digests = {s["param_sha256"] for s in summary["sites"].values() if s["status"] != "left"}
    same = len(digests) == 1 and None not in digests
    losses = [s["eval_loss"] for s in summary["sites"].values() if s["eval_loss"] is not None]
    held_out = f"held-out loss {losses[0]:.3f}, " if losses else ""
    print(
        f"{summary['status']} in {summary['wall_seconds']:.0f} s: {held_out}"
        f"{summary['wan_bytes'] / 1e6:.1f} MB over the WAN, compute utilisation "
        f"{summary['compute_utilization']:.0%}"
        + (", every site holds the same model" if same else ""),
        flush=True,
    )


def _compare(args: argparse.Namespace) -> int:
    from isthmus.deploy.launch.compare import write_comparison
    from isthmus.deploy.launch.run_dir import (
        RunError,
        default_run_dir,
        prepare_run_dir,
        resolve_job,
    )
    from isthmus.deploy.launch.warm_start import template_for_runs

    strategies = [s.strip() for s in args.compare.split(",") if s.strip()]
    unknown = [s for s in strategies if s not in STRATEGIES]
    if unknown or not strategies:
        raise UsageError(
            f"--compare: unknown strategy {unknown[0]!r}; use some of {','.join(STRATEGIES)}"
            if unknown
            else f"--compare: list strategies, e.g. --compare {','.join(STRATEGIES)}"
        )
    if len(set(strategies)) != len(strategies):
        raise UsageError("--compare: a strategy is listed twice")
    try:
        first, _ = resolve_job(Path(args.job), steps=args.steps)
        out = args.out or default_run_dir(first, "compare")
        prepare_run_dir(out)
        summaries = {}
        # The strategies' runs fork their ranks from one warm template.
        with template_for_runs(out) as template:
            for strategy in strategies:
                job, raw = resolve_job(Path(args.job), strategy=strategy, steps=args.steps)
                summaries[strategy] = run_job(
                    job,
                    raw,
                    out / strategy,
                    report=args.report,
                    template=template,
                    **_launch_options(args),
                )
                if summaries[strategy]["status"] == "interrupted":
                    break
    except RunError as exc:
        raise UsageError(str(exc)) from None
    report = write_comparison(out, summaries, plot=args.report)
    print(report.read_text().split("\n\n")[1], flush=True)  # the table
    print(f"comparison: {report}", flush=True)
    worst = max(EXIT_CODES[s["status"]] for s in summaries.values())
    return worst


def _eval(args: argparse.Namespace) -> int:
    from isthmus.job.file import load_job
    from isthmus.training.rank_setup import (
        build_model,
        builtin_dataset,
        evaluate,
        held_out_batches,
    )
    from isthmus.training.records import parameter_digest

    run_dir: Path = args.run_dir
    weights = run_dir / "model.safetensors"
    if not (run_dir / "job.yaml").is_file():
        raise UsageError(f"{run_dir}: no job.yaml here; give a directory 'isthmus run' wrote")
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    if summary.get("command"):
        where = f"{weights} holds its final model" if weights.is_file() else "it saved no model"
        raise UsageError(
            f"{run_dir} ran a script ({' '.join(summary['command'])}): isthmus eval knows only "
            f"the built-in loop's model and data; {where}: evaluate it with the script's own "
            "code (safetensors.torch.load_file)"
        )
    if not weights.is_file():
        raise UsageError(
            f"{run_dir}: no model.safetensors; the run did not finish (see its summary.json)"
        )
    from safetensors.torch import load_file

    job = load_job(run_dir / "job.yaml")
    model, _, loss_fn = build_model(job)
    try:
        model.load_state_dict(load_file(str(weights)))
    except RuntimeError as exc:
        raise UsageError(f"{weights} does not fit the job's model: {exc}") from None
    try:
        batches = held_out_batches(job, model, builtin_dataset(job, model))
    except ValueError as exc:  # the data function cannot be imported here
        raise UsageError(str(exc)) from None
    result = {
        "run": str(run_dir),
        "eval_loss": evaluate(model, batches, loss_fn),
        "param_sha256": parameter_digest(model),
    }
    if summary:
        digests = {s["param_sha256"] for s in summary["sites"].values()}
        result["matches_summary"] = result["param_sha256"] in digests
    print(to_json(result, indent=2))
    return 0


def _report(args: argparse.Namespace) -> int:
    from isthmus.deploy.launch.report import write_report

    if not (args.run_dir / "summary.json").is_file():
        raise UsageError(f"{args.run_dir}: no summary.json; give a directory 'isthmus run' wrote")
    print(f"report: {write_report(args.run_dir)}")
    return 0
