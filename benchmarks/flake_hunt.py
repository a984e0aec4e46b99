"""Flake hunt: run tests many times in a row, optionally under extra CPU load, and
report each test's failures.

A multi-process test that passes once may still depend on the machine's speed
(a fault on a clock, a fixed sleep, a timeout that races training). Running it
N times, and again with every core kept busy, shows what a slower or a busier
machine does to it. The reliability issue's target: the fault, site-loss,
membership and resume tests 10 times in a row, and 5 times under load, with 0
failures::

    python benchmarks/flake_hunt.py --repeats 10
    python benchmarks/flake_hunt.py --repeats 5 --load
    python benchmarks/flake_hunt.py tests/test_faults.py -k blackhole --repeats 2

Each repetition is one ``pytest`` process over the given tests (files, node ids,
``-k``), so the tests run as CI runs them. Progress goes to stdout as each test
ends; at the end a table of every test (runs, failures, the first failure's
line) and a JSON file (``--json``) with each failure's repetition and message.
The pytest temporary folders (run directories, logs) of a repetition with a
failure are kept under ``--keep`` for the post-mortem; the others are removed.

``--load``: one busy process per core (``os.cpu_count()``, or ``--load-procs``)
spins for as long as the hunt runs, so the tests get roughly half the CPU they
would alone: what a machine twice as slow does.

Exit status: 0 when no test failed, 1 when one did, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import re
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_TESTS = [
    "tests/test_faults.py",
    "tests/test_site_loss.py",
    "tests/test_membership.py",
    "tests/test_resume.py",
]
RESULT = re.compile(r"^(?P<id>\S+::\S+) (?P<outcome>PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")


@dataclass
class TestRecord:
    """One test's outcomes over the repetitions."""

    runs: int = 0
    passed: int = 0
    failed: int = 0
    skipped: int = 0
    seconds: list[float] = field(default_factory=list)
    failures: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "runs": self.runs,
            "passed": self.passed,
            "failed": self.failed,
            "skipped": self.skipped,
            "seconds": [round(s, 2) for s in self.seconds],
            "failures": self.failures,
        }


def _spin() -> None:
    while True:
        pass


class CpuLoad:
    """``procs`` busy processes (one per core by default), stopped on exit."""

    def __init__(self, procs: int) -> None:
        self.procs = procs
        self._children: list[multiprocessing.Process] = []

    def __enter__(self) -> CpuLoad:
        for _ in range(self.procs):
            child = multiprocessing.Process(target=_spin, daemon=True)
            child.start()
            self._children.append(child)
        return self

    def __exit__(self, *exc: object) -> None:
        for child in self._children:
            child.terminate()
        for child in self._children:
            child.join(timeout=10)


def run_once(
    tests: list[str], extra: list[str], junit: Path, basetemp: Path, prefix: str
) -> tuple[int, float]:
    """One pytest process over ``tests``; prints each test's outcome as it ends."""
    command = [
        sys.executable,
        "-m",
        "pytest",
        *tests,
        *extra,
        "-v",
        "-p",
        "no:cacheprovider",
        f"--junitxml={junit}",
        f"--basetemp={basetemp}",
    ]
    started = time.monotonic()
    proc = subprocess.Popen(
        command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        match = RESULT.match(line.strip())
        if match:
            elapsed = time.monotonic() - started
            print(f"{prefix} {elapsed:6.0f} s  {match['outcome']:7} {match['id']}", flush=True)
    return proc.wait(), time.monotonic() - started


def read_junit(path: Path) -> list[tuple[str, str, float, str]]:
    """(test id, outcome, seconds, message) of every test case in a JUnit XML file."""
    if not path.exists():
        return []
    out = []
    for case in ET.parse(path).getroot().iter("testcase"):
        classname, name = case.get("classname", ""), case.get("name", "")
        file = classname.replace(".", "/") + ".py" if classname else ""
        test_id = f"{file}::{name}" if file else name
        seconds = float(case.get("time") or 0)
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed"
                message = (child.get("message") or child.text or "").strip()
                break
            if child.tag == "skipped":
                outcome = "skipped"
        out.append((test_id, outcome, seconds, message))
    return out


def first_line(message: str, width: int = 100) -> str:
    line = next((x for x in message.splitlines() if x.strip()), "")
    return line if len(line) <= width else line[: width - 3] + "..."


def table(records: dict[str, TestRecord]) -> str:
    rows = [("test", "runs", "failed", "first failure")]
    for test_id, rec in sorted(records.items(), key=lambda kv: (-kv[1].failed, kv[0])):
        first = first_line(rec.failures[0]["message"], 70) if rec.failures else ""
        rows.append((test_id, str(rec.runs), str(rec.failed), first))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = [
        f"{r[0]:<{widths[0]}}  {r[1]:>{widths[1]}}  {r[2]:>{widths[2]}}  {r[3]}".rstrip()
        for r in rows
    ]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Arguments after '--' go to pytest as they are (e.g. -- -k blackhole -x).",
    )
    parser.add_argument(
        "tests",
        nargs="*",
        help="test files or node ids (default: the fault, site-loss, membership and resume tests)",
    )
    parser.add_argument("--repeats", type=int, default=10, help="runs in a row (default 10)")
    parser.add_argument("--load", action="store_true", help="one busy process per core")
    parser.add_argument(
        "--load-procs", type=int, default=None, help="busy processes for --load (default: cores)"
    )
    parser.add_argument("-k", dest="keyword", default=None, help="pytest's -k expression")
    parser.add_argument(
        "--json", type=Path, default=None, help="where the report goes (default: under --keep)"
    )
    parser.add_argument(
        "--keep",
        type=Path,
        default=None,
        help="folder for the report and failed repetitions' temporary folders "
        "(default: runs/flake-hunt-DATE)",
    )
    argv = sys.argv[1:] if argv is None else argv
    extra: list[str] = []
    if "--" in argv:
        at = argv.index("--")
        argv, extra = argv[:at], argv[at + 1 :]
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats: must be >= 1")
    if args.load_procs is not None and args.load_procs < 1:
        parser.error("--load-procs: must be >= 1")
    if args.load_procs is not None and not args.load:
        parser.error("--load-procs goes with --load")
    for test in args.tests:
        if not (ROOT / test.split("::")[0]).exists():
            parser.error(f"no test file {test.split('::')[0]!r} (paths are from {ROOT})")
    if args.keyword:
        extra = ["-k", args.keyword, *extra]
    return args, extra


def main(argv: list[str] | None = None) -> int:
    args, extra = parse_args(argv)
    tests = args.tests or DEFAULT_TESTS
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    keep = (args.keep or ROOT / "runs" / f"flake-hunt-{stamp}").resolve()
    keep.mkdir(parents=True, exist_ok=True)
    report_path = args.json or keep / "flake-hunt.json"
    load_procs = (args.load_procs or os.cpu_count() or 1) if args.load else 0
    print(
        f"flake hunt: {' '.join(tests + extra)}, {args.repeats} times"
        + (f", under {load_procs} busy processes" if load_procs else "")
        + f"; report in {report_path}",
        flush=True,
    )
    records: dict[str, TestRecord] = {}
    repeats: list[dict[str, Any]] = []
    started = time.monotonic()
    with CpuLoad(load_procs):
        for k in range(1, args.repeats + 1):
            junit = keep / f"rep-{k}.xml"
            basetemp = keep / f"rep-{k}"
            code, seconds = run_once(tests, extra, junit, basetemp, f"[{k}/{args.repeats}]")
            cases = read_junit(junit)
            failed = [c[0] for c in cases if c[1] == "failed"]
            for test_id, outcome, case_s, message in cases:
                rec = records.setdefault(test_id, TestRecord())
                rec.runs += 1
                rec.seconds.append(case_s)
                if outcome == "passed":
                    rec.passed += 1
                elif outcome == "skipped":
                    rec.skipped += 1
                else:
                    rec.failed += 1
                    rec.failures.append({"repeat": k, "message": message[-4000:]})
            if not cases:  # pytest could not collect or crashed: say so, count it
                failed = ["(pytest)"]
                rec = records.setdefault("(pytest)", TestRecord())
                rec.runs += 1
                rec.failed += 1
                rec.failures.append({"repeat": k, "message": f"pytest exit status {code}"})
            if failed:
                print(f"[{k}/{args.repeats}] kept {basetemp} for the failures", flush=True)
            else:
                shutil.rmtree(basetemp, ignore_errors=True)
            repeats.append(
                {"repeat": k, "seconds": round(seconds, 1), "exit": code, "failed": failed}
            )
            total_failed = sum(r.failed for r in records.values())
            print(
                f"[{k}/{args.repeats}] {len(cases)} tests, {len(failed)} failed in "
                f"{seconds:.0f} s; {total_failed} failures so far",
                flush=True,
            )
    report = {
        "command": " ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])]),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "commit": _commit(),
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "loadavg_at_end": list(os.getloadavg()),
        },
        "tests": tests,
        "pytest_args": extra,
        "repeats": args.repeats,
        "load_procs": load_procs,
        "seconds": round(time.monotonic() - started, 1),
        "per_repeat": repeats,
        "per_test": {k: v.to_dict() for k, v in sorted(records.items())},
        "failures": sum(r.failed for r in records.values()),
    }
    report_path.parent.mkdir(parents=True, exist_ok=True)
    report_path.write_text(json.dumps(report, indent=2) + "\n")
    print()
    print(table(records))
    print(f"\n{report['failures']} failures in {args.repeats} repetitions; report: {report_path}")
    return 1 if report["failures"] else 0


def _commit() -> str | None:
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


if __name__ == "__main__":
    sys.exit(main())
