"""The run directory of ``isthmus run``: the job it runs (the job file with the
command line's overrides and every default filled in), where it goes, and what a
resumed run goes on from. Apart from the launcher because ``isthmus tune``'s
trials, ``isthmus site`` and ``--compare`` prepare jobs and directories too."""

from __future__ import annotations

import dataclasses
import json
import os
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml

from isthmus.intra.checkpoint_files import checkpoint_number, complete_checkpoints
from isthmus.job.file import Job, free_port_blocks, load_job, load_yaml, parse_job
from isthmus.job.settings import STRATEGY_DEPENDENT, SettingError


class RunError(Exception):
    """The run could not start (bad input): one line naming the field or flag and the fix."""


def resolve_job(
    path: Path,
    *,
    strategy: str | None = None,
    steps: int | None = None,
    train: dict[str, Any] | None = None,
    tune: dict[str, Any] | None = None,
) -> tuple[Job, dict[str, Any]]:
    """The job file with the command line's overrides and every default filled in:
    what ``job.yaml`` in the run directory holds and every site reads. ``train`` and
    ``tune``: more overrides of those sections' keys (``isthmus tune``'s trials).
    Refuses a job that would run without TLS across a network
    (:mod:`isthmus.job.exposure`)."""
    job = load_job(path, require_tls=True)
    changes: dict[str, Any] = dict(train or {})
    if strategy is not None:
        changes["strategy"] = strategy
    # What the job file left to the defaults (absent or null) follows a strategy or
    # codec changed here: sync's gradients cross uncompressed, the DiLoCo family's
    # pseudo-gradients do not, and error feedback goes with a lossy codec.
    given = job.raw.get("train") or {}
    if "strategy" in changes or "codec" in changes:
        for key in STRATEGY_DEPENDENT:
            if given.get(key) is None and key not in changes:
                changes[key] = None
    if steps is not None:
        changes["steps"] = steps
    try:
        settings = dataclasses.replace(job.train, **changes)
    except SettingError as exc:
        raise RunError(f"--{exc.field}: {exc.reason}") from None
    if ":" in job.model or ":" in job.data:
        # Here, not at the top: checking a user's model imports torch (and their
        # module), which a job with the built-in model and data never needs.
        from isthmus.intra.plugins import load_callable
    if ":" in job.model:
        try:
            load_callable(job.model, "model")
        except ValueError as exc:
            raise RunError(f"{path}: {exc}") from None
    if ":" in job.data and not Path(job.data).exists():
        try:
            load_callable(job.data, "data")
        except ValueError as exc:
            raise RunError(f"{path}: {exc}") from None
    raw = dict(job.raw)
    raw["train"] = settings.to_dict()
    if tune:
        raw["tune"] = {**(raw.get("tune") or {}), **tune}
    raw["model"] = job.model
    raw["data"] = job.data
    raw["seed"] = job.seed
    if job.wan is None and any(s.address is None for s in job.sites):
        # No emulator to hand out addresses: give every site free loopback ports.
        bases = iter(free_port_blocks("127.0.0.1", [s.ranks for s in job.sites]))
        raw["sites"] = [
            {**site, "address": f"127.0.0.1:{next(bases)}"} if "address" not in site else site
            for site in raw["sites"]
        ]
    keep_password_out(raw)
    resolved = parse_job(yaml.safe_dump(raw, sort_keys=False), source=str(path))
    return resolved, raw


PASSWORD_VARIABLE = "ISTHMUS_CONTROL_PASSWORD"
"""Where an inline ``control.password`` goes instead of the run directory."""


def keep_password_out(raw: dict[str, Any]) -> None:
    """Move an inline broker password out of the resolved job, which is written to
    the run directory (and read by everyone who can read that): the job names an
    environment variable instead (``control.password_env``, the job's own or
    :data:`PASSWORD_VARIABLE`), set in this process, whose site processes inherit
    it. A ``--resume`` later needs that variable set again (:func:`resume_point`)."""
    control = raw.get("control")
    if not isinstance(control, dict) or control.get("password") is None:
        return
    control = dict(control)
    password = str(control.pop("password"))
    variable = control.get("password_env") or PASSWORD_VARIABLE
    os.environ.setdefault(variable, password)  # a variable already set wins, as in the job
    control["password_env"] = variable
    raw["control"] = control


def _kept_password_missing(job_path: Path) -> bool:
    """Whether the run's job.yaml had its broker password moved out by
    :func:`keep_password_out` and the variable holding it is not set now."""
    try:
        raw = load_yaml(job_path.read_text())
    except (OSError, yaml.YAMLError):
        return False  # load_job says what is wrong with it
    control = raw.get("control") if isinstance(raw, dict) else None
    return (
        isinstance(control, dict)
        and control.get("password_env") == PASSWORD_VARIABLE
        and PASSWORD_VARIABLE not in os.environ
    )


def resume_point(run_dir: Path) -> tuple[Job, dict[str, Any], int]:
    """The job of a stopped run and the newest round every site has a complete
    checkpoint of (a site killed while writing its newest has the one before)."""
    job_path = run_dir / "job.yaml"
    if not job_path.is_file():
        raise RunError(f"--resume: {run_dir} is not a run directory (no job.yaml)")
    if _kept_password_missing(job_path):
        raise RunError(
            f"--resume: the broker password of {run_dir} was kept out of its job.yaml; set "
            f"{PASSWORD_VARIABLE} to it (or use control.password_env in the job file)"
        )
    summary_path = run_dir / "summary.json"
    if summary_path.is_file():
        try:
            status = json.loads(summary_path.read_text()).get("status")
        except ValueError:
            status = None
        if status == "finished":
            raise RunError(f"--resume: the run in {run_dir} finished; nothing to go on with")
    job = load_job(job_path)
    raw = load_yaml(job_path.read_text())
    rounds: set[int] | None = None
    for site in job.sites:
        found = {
            checkpoint_number(p)
            for p in complete_checkpoints(run_dir / "checkpoints" / site.name, "round")
        }
        rounds = found if rounds is None else rounds & found
    if not rounds:
        hint = (
            "the run had train.checkpoint_every: 0 (no checkpoints); set it to resume runs"
            if not job.train.checkpoint_every
            else "it stopped before every site had written its first checkpoint"
        )
        raise RunError(f"--resume: no checkpoint that every site has in {run_dir}: {hint}")
    return job, raw, max(rounds)


def default_run_dir(job: Job, strategy: str) -> Path:
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    return Path("runs") / f"{job.name}-{strategy}-{stamp}"


def prepare_run_dir(run_dir: Path) -> None:
    """Create the run directory; one that exists and holds anything is refused."""
    if run_dir.exists() and (not run_dir.is_dir() or any(run_dir.iterdir())):
        raise RunError(
            f"--out: {run_dir} already exists and is not empty; runs never overwrite each "
            "other: pass another --out, or remove it"
        )
    try:
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)
        (run_dir / "sites").mkdir(exist_ok=True)
    except OSError as exc:
        raise RunError(f"--out: cannot create {run_dir}: {exc.strerror}") from None


COMMAND_FILE = "command.json"
"""Where a run keeps what its ranks run, for ``--resume`` to run it again."""


def save_command(run_dir: Path, command: list[str] | None) -> None:
    """Record the run's command (None: the built-in loop) in its directory."""
    from isthmus.training.records import write_json_atomic

    write_json_atomic(run_dir / COMMAND_FILE, {"command": command})


def saved_command(run_dir: Path) -> list[str] | None:
    """The command a run was started with (None: the built-in loop, or a run from
    before runs recorded it)."""
    path = run_dir / COMMAND_FILE
    if not path.is_file():
        return None
    try:
        command = json.loads(path.read_text()).get("command")
    except (ValueError, AttributeError):
        raise RunError(f"--resume: {path} is not what isthmus run wrote; pass -- CMD") from None
    if command is not None and (
        not isinstance(command, list) or not all(isinstance(a, str) for a in command)
    ):
        raise RunError(f"--resume: {path}: 'command' is not a list of strings; pass -- CMD")
    return command
