"""What a short ``isthmus run`` costs beyond training: where the seconds go.

A run of a few steps is mostly fixed cost: the launcher starts the emulator and
the ranks, every rank imports torch and joins, the sites agree on the starting
model, and at the end the ranks exit, the launcher writes the summary and the
report. That cost is paid by every run a user starts to try something, by every
trial of ``isthmus tune`` and by every multi-process test. This script runs a
short job several times and reports, per phase, the median seconds from the
launcher's start::

    python benchmarks/run_overhead.py                       # the job below, 5 runs
    python benchmarks/run_overhead.py --python OTHER/.venv/bin/python --repeats 3
    python benchmarks/run_overhead.py --job deploy/examples/two-sites.yaml --steps 4

``--python``: the interpreter whose Isthmus to run (another checkout's ``.venv``),
so two versions can be compared on the same machine in one sitting; with
``--python`` given twice, runs alternate between them. ``--env NAME=VALUE``
adds, for each interpreter, runs with that variable set, alternating too
(``--env ISTHMUS_WARM_START=0``: every rank a fresh interpreter). Phases
(seconds since the launcher started, median over the runs):

* ``ranks started``: every rank process exists (``pids.json``);
* ``joined``: the last site's rank 0 called ``isthmus.join()``;
* ``training``: the last site recorded its ``start`` (agreement and strategy done);
* ``results``: the last site wrote ``result.json`` (training and the final sync done);
* ``ranks exited``: no rank process is left;
* ``summary``: ``summary.json`` written; ``report``: ``report.md``;
* ``total``: the launcher exited;
* ``cpu``: CPU-seconds of the launcher and every process under it.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_JOB = ROOT / "benchmarks" / "jobs" / "short-two-sites.yaml"
PHASES = ["ranks started", "joined", "training", "results", "ranks exited", "summary", "report"]


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split()[2]
    except (FileNotFoundError, IndexError):
        return False
    return state != "Z"


def _last_site_reaching(out: Path, kind: str) -> float | None:
    """When the last site wrote its first record of ``kind`` (None if one has none)."""
    times = []
    for metrics in (out / "sites").glob("*/metrics.jsonl"):
        found = [
            json.loads(line)["t"]
            for line in metrics.read_text().splitlines()
            if f'"kind": "{kind}"' in line
        ]
        if not found:
            return None
        times.append(found[0])
    return max(times) if times else None


def _children_cpu() -> float:
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


def one_run(
    python: str, job: Path, steps: int | None, folder: Path, env: dict[str, str] | None = None
) -> dict[str, float]:
    """One ``isthmus run``, watched every 20 ms; the phases' times since its start."""
    out = folder / "run"
    command = [python, "-m", "isthmus", "run", str(job), "--out", str(out)]
    if steps is not None:
        command += ["--steps", str(steps)]
    cpu_before = _children_cpu()  # every level waits for its children, so all count
    start = time.time()
    launcher = subprocess.Popen(
        command,
        cwd=folder,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
    )
    seen: dict[str, float] = {}
    pids: list[int] = []
    while launcher.poll() is None:
        now = time.time() - start
        if "ranks started" not in seen and (out / "pids.json").exists():
            try:
                pids = [
                    p for ps in json.loads((out / "pids.json").read_text()).values() for p in ps
                ]
                seen["ranks started"] = now
            except json.JSONDecodeError:
                pass  # written as we read it
        if "results" in seen and "ranks exited" not in seen and not any(map(_alive, pids)):
            seen["ranks exited"] = now
        if "results" not in seen:
            results = (
                list((out / "sites").glob("*/result.json")) if (out / "sites").exists() else []
            )
            if results and len(results) == len(list((out / "sites").iterdir())):
                seen["results"] = now
        for phase, name in (("summary", "summary.json"), ("report", "report.md")):
            if phase not in seen and (out / name).exists():
                seen[phase] = now
        time.sleep(0.02)
    seen["total"] = time.time() - start
    seen["cpu"] = _children_cpu() - cpu_before
    if launcher.returncode != 0:
        raise SystemExit(f"run_overhead: the run failed:\n{launcher.stderr.read()}")
    for phase, kind in (("joined", "joined"), ("training", "start")):
        t = _last_site_reaching(out, kind)
        if t is not None:
            seen[phase] = t - start
    return seen


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python benchmarks/run_overhead.py",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--job", type=Path, default=DEFAULT_JOB, help="job file (default: %(default)s)"
    )
    parser.add_argument("--steps", type=int, default=None, help="override train.steps")
    parser.add_argument("--repeats", type=int, default=5, help="runs per interpreter (default 5)")
    parser.add_argument(
        "--python",
        action="append",
        default=None,
        help="interpreter to run Isthmus with (repeat to alternate; default: this one)",
    )
    parser.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="also run each interpreter with this variable set (repeatable; runs alternate)",
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats: must be >= 1")
    if not args.job.is_file():
        parser.error(f"--job: no such file: {args.job}")
    for item in args.env:
        if "=" not in item or not item.partition("=")[0]:
            parser.error(f"--env: expected NAME=VALUE, got {item!r}")
    variants: dict[str, tuple[str, dict[str, str]]] = {}
    for python in args.python or [sys.executable]:
        variants[python] = (python, {})
        for item in args.env:
            name, _, value = item.partition("=")
            variants[f"{python} {item}"] = (python, {name: value})
    pythons = list(variants)
    runs: dict[str, list[dict[str, float]]] = {p: [] for p in pythons}
    for i in range(args.repeats):
        for label, (python, env) in variants.items():
            folder = Path(tempfile.mkdtemp(prefix="run-overhead-"))
            try:
                phases = one_run(python, args.job.resolve(), args.steps, folder, env)
            finally:
                shutil.rmtree(folder, ignore_errors=True)
            runs[label].append(phases)
            print(
                f"[{i + 1}/{args.repeats}] {label}: {phases['total']:.2f} s, "
                f"{phases['cpu']:.1f} CPU-s",
                flush=True,
            )
    report: dict[str, Any] = {"job": str(args.job), "repeats": args.repeats, "interpreters": {}}
    header = f"{'phase (s since start, median)':32}" + "".join(f"{p[-30:]:>32}" for p in pythons)
    print(header)
    for phase in [*PHASES, "total", "cpu"]:
        row = f"{phase:32}"
        for python in pythons:
            values = [r[phase] for r in runs[python] if phase in r]
            median = statistics.median(values) if values else float("nan")
            report["interpreters"].setdefault(python, {})[phase] = round(median, 3)
            row += f"{median:>32.2f}"
        print(row)
    if args.json:
        args.json.write_text(json.dumps({**report, "runs": runs}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(main())
