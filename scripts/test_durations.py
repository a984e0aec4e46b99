"""Writes tests/durations.json from the output of a suite run with every duration:

    bash scripts/test.sh --durations=0 --durations-min=0.5 2>&1 | tee suite.txt
    .venv/bin/python scripts/test_durations.py suite.txt [more runs' output ...]

tests/conftest.py starts the longest tests first on the xdist workers, so that no
worker is left running a long test alone at the end of a pass. Tests it does not
list (new ones) count as the median, so a stale file only costs some balance.
"""

from __future__ import annotations

import json
import re
import sys
from collections import defaultdict
from pathlib import Path

LINE = re.compile(r"^(\d+(?:\.\d+)?)s (?:setup|call|teardown)\s+(\S+)$")
OUT = Path(__file__).resolve().parent.parent / "tests" / "durations.json"


def main(paths: list[str]) -> int:
    if not paths:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    runs: dict[str, list[float]] = defaultdict(list)
    for path in paths:  # each a run: a test's setup, call and teardown add up
        this_run: dict[str, float] = defaultdict(float)
        for line in Path(path).read_text(errors="replace").splitlines():
            if match := LINE.match(line.strip()):
                this_run[match[2]] += float(match[1])
        for test, spent in this_run.items():
            runs[test].append(spent)
    seconds = {test: sum(spent) / len(spent) for test, spent in runs.items()}  # the mean
    if not seconds:
        print(f"no durations in {paths}: run the suite with --durations=0", file=sys.stderr)
        return 1
    rounded = {test: round(s, 1) for test, s in sorted(seconds.items())}
    OUT.write_text(json.dumps(rounded, indent=0) + "\n")
    print(f"{OUT}: {len(rounded)} tests, {sum(rounded.values()):.0f} s in all")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
