"""How long Ctrl-C takes to stop a 2-site run of your own script.

    python benchmarks/script_stop.py [--trials 5]

Each trial starts ``isthmus run JOB -- python train_mlp.py`` (a small MLP, its own
loop, DiLoCo every 20 steps over emulated 20 ms links), waits for the first
round, sends SIGINT to the launcher (what Ctrl-C does: the ranks run in sessions
of their own), and times until the launcher and every process it started are
gone. Prints each trial and the median; checks the summary was written.
Target: median <= 2 s.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SCRIPT = """\
import torch, isthmus
site = isthmus.join()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
with site.strategy(model, opt):
    for step in site.steps():
        x = torch.randn(16, 32)
        loss = ((model(x) - x.sum(1, keepdim=True)) ** 2).mean()
        opt.zero_grad(); loss.backward(); opt.step()
        site.log(loss=loss.item())
"""
JOB = """\
name: stop-{n}
sites: [{{name: a}}, {{name: b}}]
wan: {{default: {{rtt_ms: 20}}}}
train: {{strategy: diloco, steps: 100000, sync_every: 20}}
"""


def descendants(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-eo", "pid,ppid"], capture_output=True, text=True).stdout
    children: dict[int, list[int]] = {}
    for line in out.splitlines()[1:]:
        p, parent = map(int, line.split())
        children.setdefault(parent, []).append(p)
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def trial(folder: Path, n: int) -> float:
    (folder / "train_mlp.py").write_text(SCRIPT)
    (folder / "job.yaml").write_text(JOB.format(n=n))
    run = folder / f"run{n}"
    isthmus = shutil.which("isthmus") or str(Path(sys.executable).parent / "isthmus")
    launcher = subprocess.Popen(
        [isthmus, "run", "job.yaml", "--out", str(run), "--no-report", "--",
         sys.executable, "train_mlp.py"],
        cwd=folder, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    deadline = time.monotonic() + 180
    records = run / "sites" / "a" / "metrics.jsonl"
    while time.monotonic() < deadline:
        if records.exists() and '"kind": "round"' in records.read_text():
            break
        time.sleep(0.2)
    else:
        launcher.kill()
        raise SystemExit(f"trial {n}: no round within 180 s")
    watched = descendants(launcher.pid)
    started = time.monotonic()
    os.kill(launcher.pid, signal.SIGINT)
    launcher.wait(60)
    while any(Path(f"/proc/{p}").exists() for p in watched) and time.monotonic() - started < 60:
        time.sleep(0.02)
    took = time.monotonic() - started
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "interrupted", summary["status"]
    return took


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="isthmus-stop-") as tmp:
        times = []
        for n in range(args.trials):
            times.append(trial(Path(tmp), n))
            print(f"trial {n}: every process gone {times[-1]:.2f} s after SIGINT", flush=True)
    print(f"median {statistics.median(times):.2f} s over {args.trials} trials "
          f"(max {max(times):.2f} s)")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
