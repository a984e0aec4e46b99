"""What a launcher tells the training script it starts, through the environment.

``isthmus run JOB -- CMD`` and ``isthmus site JOB --site NAME -- CMD`` start
CMD once per rank with torchrun's variables (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) and
these of Isthmus's own; ``isthmus.join()`` with no arguments reads them.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

JOB = "ISTHMUS_JOB"
"""The job file the script trains (the run directory's resolved ``job.yaml``)."""
SITE = "ISTHMUS_SITE"
"""Which of the job's sites this process is a rank of."""
RUN_DIR = "ISTHMUS_RUN_DIR"
"""Where the site writes its records, result and checkpoints (``sites/SITE/``)."""
WAN_STATE = "ISTHMUS_WAN_STATE"
"""The WAN emulator's state file, when ``isthmus run`` emulates the links."""
REJOIN = "ISTHMUS_REJOIN"
"""``1``: the other sites are training; wait to be admitted and pull their state."""
RESUME_ROUND = "ISTHMUS_RESUME_ROUND"
"""Go on from the site's checkpoint after this round (``isthmus run --resume``)."""
RUN_OVER_STATUS = 3
"""The exit status of a rank whose site came back (restarted, or let back in) after
every other site had finished training: the run is over for it, not failed, and
the launcher does not start it again."""
METRICS_PORTS = "ISTHMUS_METRICS_PORTS"
"""The port of each rank's ``/metrics``, comma-separated (``isthmus run`` of a job
with ``metrics:``; see :mod:`isthmus.training.prometheus`)."""

HOW_TO_LAUNCH = (
    "start the script through a launcher: `isthmus run JOB.yaml -- python train.py` "
    "(every site on this machine, through the emulated WAN) or `isthmus site JOB.yaml "
    "--site NAME -- python train.py` (one site of a real cluster); or name the job and "
    "site yourself: isthmus.join('JOB.yaml', site='NAME')"
)


class NotLaunched(RuntimeError):
    """``isthmus.join()`` with no job outside a launcher."""


@dataclass(frozen=True)
class LaunchEnvironment:
    """The launcher's word on this process: its job, site, run directory, and how
    it starts (fresh, rejoining, resuming)."""

    job: Path
    site: str
    run_dir: Path | None = None
    wan_state: Path | None = None
    rejoin: bool = False
    resume_round: int | None = None

    def to_environ(self) -> dict[str, str]:
        """The variables a launcher sets for the script (torchrun's are its own)."""
        env = {JOB: str(self.job), SITE: self.site}
        if self.run_dir is not None:
            env[RUN_DIR] = str(self.run_dir)
        if self.wan_state is not None:
            env[WAN_STATE] = str(self.wan_state)
        if self.rejoin:
            env[REJOIN] = "1"
        if self.resume_round is not None:
            env[RESUME_ROUND] = str(self.resume_round)
        return env

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> LaunchEnvironment:
        env = os.environ if environ is None else environ
        missing = [name for name in (JOB, SITE) if not env.get(name)]
        if missing:
            raise NotLaunched(
                f"isthmus.join(): this process was not started by an Isthmus launcher "
                f"({' and '.join(missing)} not set); {HOW_TO_LAUNCH}"
            )
        resume = env.get(RESUME_ROUND) or None
        if resume is not None and not resume.isdigit():
            raise NotLaunched(f"{RESUME_ROUND}: must be a round number, got {resume!r}")
        return cls(
            job=Path(env[JOB]),
            site=env[SITE],
            run_dir=Path(env[RUN_DIR]) if env.get(RUN_DIR) else None,
            wan_state=Path(env[WAN_STATE]) if env.get(WAN_STATE) else None,
            rejoin=env.get(REJOIN, "") == "1",
            resume_round=int(resume) if resume is not None else None,
        )
