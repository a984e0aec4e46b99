"""What a test needs of the machine, in one place: each ``needs_*`` marker skips
its tests where that is missing, with a reason that says what is missing and the
one command that brings it.

Every reason starts ``needs X:``; ``scripts/test.sh`` ends with one line per
skipped group (``conftest.py`` records the skips), so a machine that ran less
than the whole suite says so, and how to run the rest.

Where root and apt are at hand, ``bash scripts/test.sh`` installs all of it
itself (Mosquitto, Slurm and munge, podman), so only the GPU tests skip there.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
INSTALLS = "run as root: bash scripts/test.sh (it installs it with apt)"


def program(name: str) -> str | None:
    """The path of ``name`` on PATH, or in the sbin folders a non-root PATH lacks."""
    found = shutil.which(name)
    if found:
        return found
    for folder in ("/usr/sbin", "/sbin", "/usr/bin"):
        if Path(folder, name).exists():
            return str(Path(folder, name))
    return None


MOSQUITTO = program("mosquitto")
"""The real MQTT broker the control-plane tests start, or None."""

needs_mosquitto = pytest.mark.skipif(
    MOSQUITTO is None,
    reason=f"needs mosquitto: not installed; {INSTALLS} (apt-get install mosquitto "
    "mosquitto-clients)",
)


LIBFAKETIME = next(
    (
        str(path)
        for path in Path("/usr/lib").glob("*/faketime/libfaketimeMT.so.1")
        if path.is_file()
    ),
    None,
)
"""libfaketime (multi-threaded): a process's own wall clock, set off by an offset."""

needs_faketime = pytest.mark.skipif(
    LIBFAKETIME is None,
    reason=f"needs libfaketime: not installed; {INSTALLS} (apt-get install faketime)",
)

needs_root = pytest.mark.skipif(
    os.geteuid() != 0,
    reason="needs root: mounts a small tmpfs to fill a disk; run the suite as root "
    "(as CI does): sudo bash scripts/test.sh",
)


def _has_transformers() -> bool:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


needs_transformers = pytest.mark.skipif(
    not _has_transformers(),
    reason="needs transformers: the hf extra is not installed; run: bash scripts/setup.sh "
    "(requirements/dev.txt holds it)",
)


def podman_missing() -> str | None:
    """Why the container tests cannot run here, or None. Quick, never hangs:
    ``scripts/containers.sh --check`` runs ``podman info`` under a timeout."""
    if os.geteuid() != 0:
        return "needs podman: the container tests run rootful podman; run them as root"
    try:
        done = subprocess.run(
            ["bash", str(ROOT / "scripts" / "containers.sh"), "--check"],
            capture_output=True, text=True, timeout=90,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        return "needs podman: `podman info` did not answer in 90 s; run: bash scripts/containers.sh"
    if done.returncode != 0:
        said = (done.stdout + done.stderr).strip().splitlines()
        return f"needs podman: {said[-1] if said else 'not ready'}"
    return None


SKIP_LOG_VARIABLE = "ISTHMUS_SKIP_LOG"
"""Where ``conftest.py`` appends one JSON line per skipped test, and per figure a
test measured (``record_property("figure", ...)``); scripts/test.sh sets it."""


def _append(entry: dict[str, str]) -> None:
    log = os.environ.get(SKIP_LOG_VARIABLE)
    if log:
        with open(log, "a", encoding="utf-8") as out:
            out.write(json.dumps(entry) + "\n")


def record_skip(nodeid: str, longrepr: object) -> None:
    """Append a skipped test (or module) and its reason to the skip log, if one is set."""
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    _append({"test": nodeid, "reason": reason.removeprefix("Skipped: ")})


def record_figure(nodeid: str, figure: str) -> None:
    """Append a figure a test measured (the image's size, a start-up time)."""
    _append({"test": nodeid, "figure": figure})


def summary(log: Path) -> list[str]:
    """The figures tests measured, then one line per group of skipped tests: how
    many, why, and the command that enables them (a reason's ``needs X`` head)."""
    if not log.exists():
        return []
    groups: dict[str, list[str]] = {}
    reasons: dict[str, list[str]] = {}
    figures: list[str] = []
    for line in log.read_text(encoding="utf-8").splitlines():
        entry = json.loads(line)
        if "figure" in entry:
            figures.append(f"measured: {entry['figure']}")
            continue
        head, _, rest = entry["reason"].partition(":")
        groups.setdefault(head, []).append(entry["test"])
        said = reasons.setdefault(head, [])
        if (rest.strip() or head) not in said:
            said.append(rest.strip() or head)
    lines = []
    for head, tests in sorted(groups.items(), key=lambda g: -len(g[1])):
        why = reasons[head][0]
        if len(reasons[head]) > 1:
            why += f" (and {len(reasons[head]) - 1} other reason(s))"
        lines.append(f"skipped {len(set(tests))} ({head}): {why}")
    return figures + lines


if __name__ == "__main__":
    lines = summary(Path(sys.argv[1]))
    if not any(line.startswith("skipped") for line in lines):
        lines.append("skipped none")
    print("\n".join(lines))
