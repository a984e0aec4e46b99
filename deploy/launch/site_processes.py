"""The processes of one site of ``isthmus run``: the environment its ranks get,
how they start and stop, and how their end is told.

Each rank runs the user's command (``isthmus run JOB -- CMD``) or the built-in
training loop (:func:`isthmus.deploy.launch.launcher.builtin_command`), with
torchrun's variables and the launcher's word on the job
(:class:`~isthmus.training.environment.LaunchEnvironment`); the script
learns its job, site and rank from them when it calls ``isthmus.join()``.
Apart from the launcher, which follows the run, so that each stays one idea.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

from isthmus.deploy.launch.warm_start import ForkedRank, RankTemplate, signal_rank
from isthmus.intra.launch import free_port, rank_environment
from isthmus.training.environment import LaunchEnvironment
from isthmus.training.orphan import parent_environment

STOP_GRACE_S = 10.0
"""How long a stopped process gets to exit on SIGTERM before SIGKILL."""


def site_environment(
    run_dir: Path, site: str, *, rejoin: bool = False, resume_round: int | None = None
) -> dict[str, str]:
    """The ``ISTHMUS_*`` variables of every rank of ``site`` (torchrun's are per rank);
    paths absolute, for a script that changes its directory."""
    run_dir = run_dir.resolve()
    wan_state = run_dir / "wan.json"
    return LaunchEnvironment(
        job=run_dir / "job.yaml",
        site=site,
        run_dir=run_dir,
        wan_state=wan_state if wan_state.exists() else None,
        rejoin=rejoin,
        # A rejoining site pulls the others' state; it has no checkpoint to go on from.
        resume_round=None if rejoin else resume_round,
    ).to_environ()


def launch(
    command: list[str],
    ranks: int,
    env: dict[str, str],
    logs: list[Path],
    template: RankTemplate | None = None,
) -> list[subprocess.Popen | ForkedRank]:
    """One process per rank with torchrun's environment, each logging to its own
    file and in its own session (a terminal's Ctrl-C reaches the launcher only); each
    stops when the launcher is gone (:mod:`isthmus.training.orphan`). With a
    ``template``, the ranks of the built-in loop are forked from it
    (:mod:`isthmus.deploy.launch.warm_start`); any other command starts afresh."""
    master_port = free_port()
    base = {**os.environ, **env, **parent_environment()}
    envs = [{**base, **rank_environment(rank, ranks, master_port)} for rank in range(ranks)]
    if template is not None:
        return [template.spawn([], e, log) for e, log in zip(envs, logs, strict=True)]
    procs: list[subprocess.Popen | ForkedRank] = []
    for rank_env, log in zip(envs, logs, strict=True):
        with log.open("ab") as out:  # the child holds its own copy of the descriptor
            procs.append(
                subprocess.Popen(
                    command,
                    env=rank_env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
    return procs


def terminate(procs: Sequence[subprocess.Popen | ForkedRank]) -> None:
    """SIGTERM to each live process group, SIGKILL to those still there after the grace."""
    live = [p for p in procs if p.poll() is None]
    for p in live:
        _signal_group(p, signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    for p in live:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal_group(p, signal.SIGKILL)
            p.wait()


def _signal_group(proc: subprocess.Popen | ForkedRank, sig: int) -> None:
    # A rank forked a moment ago may not lead its own group yet (it blocks the stop
    # signals until it does): the process itself, then.
    signal_rank(proc.pid, sig)


def exit_reason(rank: int, code: int, log: Path) -> str:
    """Why a rank ended badly, for the site's reason: its signal or its exit status
    and the most telling line of its log."""
    if code < 0:
        return f"rank {rank} killed by {signal.Signals(-code).name} (log: {log})"
    line = log_tail(log)
    said = f": {line}" if line else " and printed nothing"
    return f"rank {rank} exit status {code}{said} (log: {log})"


def log_tail(log: Path, lines: int = 40) -> str:
    """The most telling line of a log's end: the exception line of its last
    traceback (a script's own exception need not say "error"), else its last error
    line, else its last line ("" for an empty or missing log)."""
    try:
        text = log.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    tracebacks = [i for i, line in enumerate(text) if line.startswith("Traceback (most recent")]
    if tracebacks:
        # The exception line: the first unindented line after the traceback's frames
        # (a background thread may log after it, so it is not the log's last line).
        for line in text[tracebacks[-1] + 1 :]:
            if line and not line[0].isspace():
                return line.strip()
    text = text[-lines:]
    for line in reversed(text):
        if "error" in line.lower():
            return line.strip()
    return text[-1].strip() if text else ""
