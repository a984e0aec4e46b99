"""``isthmus tune JOB -- python train_mlp.py``: is the calibrated step time the script's?

    python benchmarks/script_calibration.py [--repeats 3]

The script (written here) trains an MLP with SGD in its own loop and times each
whole iteration of it with ``perf_counter`` (its batch, forward, backward,
``optimizer.step()``, and what Isthmus does between its steps), logging it as
``site.log(previous_step_s=...)``. Each repeat runs

1. ``isthmus tune JOB --budget-minutes 0 --json -- python train_mlp.py``: its
   calibration run of the script gives the step time the tuner plans with;
2. ``isthmus run JOB -- python train_mlp.py``, the job as it is: the script's
   own median step time (its logged iterations, every site, those that end a
   round left out: they include the exchange).

Prints each repeat's pair and their ratio, and the median ratio. Target: within
20% (0.8-1.2). Also checks that the tuner named the script and counted its
parameters.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HIDDEN = 512
SCRIPT = f"""\
import time, torch, isthmus
site = isthmus.join()
site.describe(model="mlp-256-{HIDDEN}-{HIDDEN}-10", data="random")
torch.manual_seed(0)
model = torch.nn.Sequential(
    torch.nn.Linear(256, {HIDDEN}), torch.nn.ReLU(),
    torch.nn.Linear({HIDDEN}, {HIDDEN}), torch.nn.ReLU(), torch.nn.Linear({HIDDEN}, 10),
)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
last = None
with site.strategy(model, optimizer):
    for step in site.steps():
        now = time.perf_counter()
        # The loop's own clock: one whole iteration, from its start to the next one's.
        timing = {{"previous_step_s": now - last}} if last is not None else {{}}
        last = now
        g = torch.Generator().manual_seed(step * 7 + site.site_index)
        x, y = torch.randn(64, 256, generator=g), torch.randint(0, 10, (64,), generator=g)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        site.log(loss=loss.item(), tokens=len(x), **timing)
"""
PARAMETERS = 256 * HIDDEN + HIDDEN + HIDDEN * HIDDEN + HIDDEN + HIDDEN * 10 + 10
JOB = """\
name: mlp
sites:
  - {name: a, ranks: 1}
  - {name: b, ranks: 1}
wan:
  default: {rtt_ms: 20, bandwidth_mbit: 100}
train: {strategy: diloco, steps: 300, sync_every: 25}
"""
SYNC_EVERY = 25


def _isthmus(folder: Path, *args: str) -> subprocess.CompletedProcess:
    done = subprocess.run(
        [sys.executable, "-m", "isthmus", *args],
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    if done.returncode:
        raise SystemExit(f"isthmus {args[0]} failed: {done.stderr[-2000:]}")
    return done


def script_step_s(run_dir: Path) -> float:
    """The median of the script's own step times (whole loop iterations), every site,
    the iterations that ended a round left out (they hold the exchange). Step N's
    record (1-based) carries iteration N-1's time."""
    times = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        ended_a_round = (record.get("step", 1) - 1) % SYNC_EVERY == 0
        if record.get("kind") == "step" and "previous_step_s" in record and not ended_a_round:
            times.append(record["previous_step_s"])
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    ratios = []
    with tempfile.TemporaryDirectory(prefix="isthmus-script-calibration-") as scratch:
        folder = Path(scratch)
        (folder / "train_mlp.py").write_text(SCRIPT)
        (folder / "job.yaml").write_text(JOB)
        command = ["--", sys.executable, "train_mlp.py"]
        for repeat in range(args.repeats):
            tuned = json.loads(
                _isthmus(
                    folder, "tune", "job.yaml", "--budget-minutes", "0", "--json",
                    "--out", f"tune-{repeat}", *command,
                ).stdout
            )  # fmt: skip
            if f"{PARAMETERS:,} parameters" not in tuned["calibrated"]:
                raise SystemExit(f"the tuner calibrated something else: {tuned['calibrated']}")
            _isthmus(folder, "run", "job.yaml", "--out", f"run-{repeat}", "--no-report", *command)
            own = script_step_s(folder / f"run-{repeat}")
            ratio = tuned["step_s"] / own
            ratios.append(ratio)
            print(
                f"repeat {repeat + 1}: tune calibrated {tuned['step_s'] * 1e3:.2f} ms a step, "
                f"the script timed its own steps at {own * 1e3:.2f} ms (median): {ratio:.3f}",
                flush=True,
            )
        print(f"calibrated: {tuned['calibrated']}")
    median = statistics.median(ratios)
    verdict = "pass" if 0.8 <= median <= 1.2 else "FAIL"
    print(f"median ratio {median:.3f} (target 0.8-1.2): {verdict}")
    return 0 if verdict == "pass" else 1


if __name__ == "__main__":
    raise SystemExit(main())
