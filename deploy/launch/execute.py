"""One run, start to summary: what ``isthmus run`` and the tuner's trials share.

The command line (:mod:`isthmus.deploy.cli.run`) adds the progress display and
the report; the tuner (:mod:`isthmus.deploy.tune.trials`) runs short trials.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from isthmus.deploy.launch.launcher import JOIN_TIMEOUT_S, Launcher
from isthmus.deploy.launch.summary import build_summary
from isthmus.deploy.launch.tensorboard import TensorBoardWriter
from isthmus.job.settings import applied_settings
from isthmus.training.records import write_json_atomic


def execute_run(
    job: Any,
    raw: dict[str, Any],
    run_dir: Path,
    *,
    on_update: Any = None,
    resume_round: int | None = None,
    restart_lost: bool = False,
    command: list[str] | None = None,
    join_timeout_s: float = JOIN_TIMEOUT_S,
    template: Any = None,
) -> dict[str, Any]:
    """Launch, follow and stop one run in a prepared directory; write its TensorBoard
    events and summary.json and return the summary. Prints nothing. ``command``:
    what every rank runs (None: the built-in loop). ``template``: a warm template
    shared with other runs (:func:`~isthmus.deploy.launch.warm_start.template_for_runs`)."""
    launcher = Launcher(
        job,
        raw,
        run_dir,
        on_update=on_update,
        resume_round=resume_round,
        restart_lost=restart_lost,
        command=command,
        join_timeout_s=join_timeout_s,
        template=template,
    )
    launcher.tensorboard = TensorBoardWriter(
        run_dir / "tensorboard",
        [s.name for s in job.sites],
        applied_settings(job.train, builtin_loop=command is None),
    )
    try:
        launcher.start()
        launcher.follow()
    except KeyboardInterrupt:
        launcher.state.status = "interrupted"
    finally:
        launcher.stop()
        launcher.tensorboard.close()
    if launcher.state.status == "running":  # start() failed
        launcher.state.status = "failed"
    summary = build_summary(launcher.state)
    write_json_atomic(run_dir / "summary.json", summary)
    return summary
