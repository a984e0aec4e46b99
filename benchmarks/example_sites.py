"""Run the DiLoCo example (``deploy/examples/diloco_train.py``) once per site on
this machine, each site a separate process forked from a warm template: the
harness behind the strategy tests and benchmarks (a user runs the example once
per site, on each site's machine)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from isthmus.job.file import free_port_blocks


def loopback_job(
    path: Path, name: str, sites: Sequence[str], wan: str = "", train: str = ""
) -> Path:
    """Write a job file whose sites listen on free loopback ports (``wan``, ``train``:
    optional ``wan:`` and ``train:`` sections, as YAML text)."""
    bases = free_port_blocks("127.0.0.1", [1] * len(sites))
    lines = [f"name: {name}", "sites:"]
    lines += [
        f"  - {{name: {s}, address: 127.0.0.1:{b}}}" for s, b in zip(sites, bases, strict=True)
    ]
    path.write_text("\n".join(lines) + "\n" + wan + train)
    return path


def run_sites(
    job: Path,
    sites: Sequence[str],
    args: Sequence[str],
    out: Path,
    *,
    cwd: Path | None = None,
    timeout_s: float = 3600,
) -> dict[str, dict[str, Any]]:
    """Run this example once per site, each a separate process, and return every
    site's report (written to ``out/SITE.json``). Raises with the end of each
    failing site's stderr: a site that crashes makes its peers fail later."""
    from warm_popen import popen

    # Forked from a warm template (one torch import, not one per site and call).
    procs = {
        site: popen(
            [
                *(sys.executable, "-m", "isthmus.deploy.examples.diloco_train", str(job), site),
                *(*args, "--out", str(out / f"{site}.json")),
            ],
            cwd=cwd,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        for site in sites
    }
    failures = []
    for site, proc in procs.items():
        _, err = proc.communicate(timeout=timeout_s)
        if proc.returncode:
            failures.append(f"site {site} exited {proc.returncode}:\n{err.decode()[-1500:]}")
    if failures:
        raise RuntimeError("\n\n".join(failures))
    return {site: json.loads((out / f"{site}.json").read_text()) for site in sites}
