"""``isthmus deploy render JOB.yaml --target slurm|kubernetes --out DIR``.

Writes the files that run a job's sites on real clusters (see
:mod:`isthmus.deploy.render.cluster` and docs/deploy.md), lists them, and says what to
do next.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any

from isthmus.deploy.render import cluster as render
from isthmus.deploy.render import kubernetes
from isthmus.deploy.usage import UsageError, add_command
from isthmus.job.file import load_job


def register(commands: Any) -> None:
    deploy = commands.add_parser(
        "deploy",
        help="files that run a job's sites on real clusters (Slurm, Kubernetes)",
        description="Render ready-to-submit files for a job whose sites are real clusters.",
    )
    verbs = deploy.add_subparsers(dest="verb", metavar="VERB", parser_class=type(deploy))
    verbs.required = True

    sub = add_command(
        verbs,
        "render",
        _render,
        help="write Slurm batch scripts or Kubernetes manifests for every site, and the broker",
    )
    sub.add_argument("job", metavar="JOB.yaml", help="the job file; every site needs an address")
    sub.add_argument(
        "--target", required=True, choices=render.TARGETS, help="what the sites' clusters run"
    )
    sub.add_argument(
        "--out", required=True, type=Path, metavar="DIR", help="must not exist or be empty"
    )
    sub.add_argument(
        "--gpus",
        action="store_true",
        help="the sites use GPUs, one per rank (Slurm --gpus-per-node, Kubernetes "
        "nvidia.com/gpu limits)",
    )
    slurm = sub.add_argument_group("slurm")
    slurm.add_argument(
        "--job-path",
        metavar="PATH",
        help="where the job file is on the clusters (default: JOB.yaml, made absolute)",
    )
    slurm.add_argument(
        "--run-dir",
        metavar="DIR",
        help="where each site writes its run; {site} is the site's name (default: "
        "runs/<job>-{site} beside the job file; a relative DIR is taken from the job "
        "file's folder, so the run lands in one place wherever sbatch is run)",
    )
    slurm.add_argument(
        "--cpus-per-rank",
        type=int,
        default=1,
        metavar="N",
        help="CPUs each rank gets (--cpus-per-task = N x ranks per node; default 1: "
        "give more for data loaders)",
    )
    kubernetes = sub.add_argument_group("kubernetes")
    kubernetes.add_argument(
        "--image",
        help="the sites' container image, with isthmus installed (default: what "
        f"deploy/images/Dockerfile builds, {render.DEFAULT_IMAGE}, or with --gpus "
        f"{render.DEFAULT_GPU_IMAGE})",
    )


# An OCI image reference: [registry[:port]/]path[:tag][@digest] (the distribution spec's
# grammar, lower-case path components), so a typo fails here and not in every pod.
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_IMAGE = re.compile(
    rf"^(?:[A-Za-z0-9.-]+(?::[0-9]+)?/)?{_COMPONENT}(?:/{_COMPONENT})*"
    r"(?::[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?(?:@[a-z0-9]+:[a-f0-9]{32,})?$"
)


def check_image(image: str) -> None:
    if not _IMAGE.match(image):
        raise UsageError(
            f"--image: {image!r} is not an image reference; give "
            "[REGISTRY/]NAME[:TAG][@sha256:DIGEST], lower-case, no spaces, "
            "e.g. ghcr.io/acme/isthmus:0.1"
        )


def _render(args: argparse.Namespace) -> int:
    if args.image is None:
        args.image = render.DEFAULT_GPU_IMAGE if args.gpus else render.DEFAULT_IMAGE
    if args.target == "kubernetes":
        check_image(args.image)
    job = load_job(args.job)
    if args.target == "slurm":
        if args.cpus_per_rank < 1:
            raise UsageError(f"--cpus-per-rank: must be >= 1, got {args.cpus_per_rank}")
        job_path = args.job_path or str(Path(args.job).resolve())
        run_dir = Path(args.run_dir or f"runs/{job.name}-{{site}}")
        if not run_dir.is_absolute():
            run_dir = Path(job_path).parent / run_dir
        files = render.render_slurm(
            job,
            job_path=job_path,
            run_dir=str(run_dir),
            gpus=args.gpus,
            submit_from=str(args.out),
            cpus_per_rank=args.cpus_per_rank,
        )
    else:
        files = kubernetes.render_kubernetes(job, image=args.image, gpus=args.gpus)
    for path in render.write_files(files, args.out):
        print(path)
    print("\nNext steps:")
    for number, step in enumerate(render.next_steps(job, args.target, args.out), start=1):
        print(f"  {number}. {step}")
    return 0
