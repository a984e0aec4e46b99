"""``isthmus site JOB.yaml --site NAME``: the command line of one site of a job on a
real cluster. What it does is the cluster launcher,
:mod:`isthmus.deploy.launch.cluster_site`."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from isthmus.deploy.usage import accept_command, add_command
from isthmus.job.ports import RDZV_PORT
from isthmus.training.log_format import FORMATS


def _site(args: argparse.Namespace) -> int:
    from isthmus.deploy.launch.cluster_site import run_site

    return run_site(args)


def register(commands: Any) -> None:
    sub = add_command(
        commands,
        "site",
        _site,
        help="run one site of a job on this cluster (under torchrun, or starting it)",
        description="Run one site of a job on a real cluster. Under torchrun every rank "
        "runs this command; otherwise it starts torchrun with the site's layout from the "
        "job file (on every node of a multi-node site, with --rdzv-endpoint). Every rank "
        "runs CMD (your training script, which calls isthmus.join()), or Isthmus's "
        "built-in training loop without -- CMD.",
    )
    sub.usage = "%(prog)s JOB.yaml --site NAME [options] [-- CMD [ARGS...]]"
    sub.epilog = (
        "-- CMD [ARGS...]: the command every rank of the site runs, e.g. `isthmus site "
        "job.yaml --site a -- python train.py`; it learns its job, site and rank from the "
        "environment (ISTHMUS_JOB, ISTHMUS_SITE, RANK, ...; see docs/run.md)."
    )
    accept_command(sub)
    sub.add_argument("job", metavar="JOB.yaml", help="the job file, the same on every site")
    sub.add_argument("--site", required=True, metavar="NAME", help="which of the job's sites")
    sub.add_argument(
        "--out",
        type=Path,
        metavar="DIR",
        help="the site's own run directory: metrics, result, checkpoints "
        "(default: runs/<job>-<site>)",
    )
    sub.add_argument(
        "--rdzv-endpoint",
        metavar="HOST:PORT",
        help=f"a multi-node site's rendezvous: its first node, port {RDZV_PORT} by default",
    )
    sub.add_argument(
        "--rejoin",
        action="store_true",
        help="the other sites are training: wait to be admitted, pull the global state "
        "from one of them, and train on (2 sites or more)",
    )
    sub.add_argument(
        "--resume",
        type=Path,
        metavar="RUN_DIR",
        help="go on from this site's newest checkpoint in RUN_DIR (its earlier --out): "
        "when every site resumes, all go on from the newest round every site holds; when "
        "another site is live, this one rejoins it and pulls its state instead (see "
        "docs/two-clusters.md#resuming-a-stopped-job)",
    )
    sub.add_argument(
        "--node-rank",
        type=int,
        metavar="N",
        help="which node of a multi-node site this is (0 first), for --resume; Slurm's "
        "SLURM_NODEID or a Kubernetes indexed job's JOB_COMPLETION_INDEX gives it when "
        "this flag does not",
    )
    sub.add_argument(
        "--log-format",
        choices=FORMATS,
        default="text",
        help="text (default), or json: every line this site and its ranks print as one "
        "JSON object (time, level, logger, site, rank, message), for log shippers",
    )
    sub.add_argument(
        "--print-ports",
        action="store_true",
        help="print the addresses and ports a firewall must open for this site, and exit",
    )
