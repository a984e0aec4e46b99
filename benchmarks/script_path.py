"""The built-in model through the script path against a reference Isthmus's built-in loop.

The one-training-path issue's target: ``isthmus run JOB -- python -m
isthmus.training.worker`` (the built-in loop as a script of the public API:
``isthmus.join()``, ``site.strategy()``, ``site.steps()``, ``site.log()``)
trains as fast as the built-in loop did before it went through that API,
tokens/s within 2%.

The reference is another Isthmus install: a Python whose ``isthmus`` is the
code to compare against (``--baseline-python``), e.g. one made from a git
worktree of the commit before the change::

    git worktree add /tmp/isthmus-base 1fa7870
    cp -a .venv /tmp/isthmus-base/ && cd /tmp/isthmus-base && \\
        .venv/bin/python -m pip install -q --no-deps --no-build-isolation -e .
    python benchmarks/script_path.py --baseline-python /tmp/isthmus-base/.venv/bin/python

Runs alternate (reference, script, reference, ...) so that a machine's drift
hits both alike. Each run's figure is its steady-state tokens/s: for each site,
the tokens between its first and last step record over the time between them
(start-up, the first step and the final synchronisation left out), summed over
the sites. Printed: each run, the medians, and their ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def steady_tokens_per_s(run_dir: Path) -> float:
    total = 0.0
    for records in sorted((run_dir / "sites").glob("*/metrics.jsonl")):
        steps = [
            json.loads(line)
            for line in records.read_text().splitlines()
            if line.strip() and '"kind": "step"' in line
        ]
        if len(steps) < 3:
            raise RuntimeError(f"{records}: fewer than 3 step records")
        first, last = steps[0], steps[-1]
        total += (last["tokens"] - first["tokens"]) / (last["t"] - first["t"])
    return total


def one_run(python: str, job: Path, steps: int, script: bool, tmp: Path, n: int) -> float:
    out = tmp / f"run-{n}-{'script' if script else 'reference'}"
    command = [python, "-m", "isthmus", "run", str(job), "--steps", str(steps), "--out", str(out)]
    if script:
        command += ["--", python, "-m", "isthmus.training.worker"]
    done = subprocess.run(command, cwd=tmp, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr[-2000:]}")
    return steady_tokens_per_s(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--baseline-python",
        required=True,
        help="a Python whose isthmus is the reference (see the module's docs)",
    )
    parser.add_argument("--job", type=Path, default=ROOT / "deploy/examples/two-sites.yaml")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    runs: dict[str, list[float]] = {"reference": [], "script": []}
    with tempfile.TemporaryDirectory(prefix="isthmus-script-path-") as name:
        tmp = Path(name)
        for i in range(args.repeats):
            for kind, python in (("reference", args.baseline_python), ("script", sys.executable)):
                rate = one_run(python, args.job.resolve(), args.steps, kind == "script", tmp, i)
                runs[kind].append(rate)
                print(f"[{i + 1}/{args.repeats}] {kind:9s} {rate:10,.0f} tokens/s", flush=True)
    medians = {kind: statistics.median(rates) for kind, rates in runs.items()}
    ratio = medians["script"] / medians["reference"]
    figures: dict[str, Any] = {
        "job": str(args.job),
        "steps": args.steps,
        "runs": runs,
        "median_tokens_per_s": medians,
        "script_over_reference": ratio,
    }
    print(
        f"median tokens/s: reference {medians['reference']:,.0f}, script path "
        f"{medians['script']:,.0f}: ratio {ratio:.3f} (target: within 0.98-1.02 or faster)"
    )
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
