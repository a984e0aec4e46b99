"""Training throughput of each strategy on an emulated three-continent WAN, against no sync.

The three sites of ``deploy/examples/three-continents.yaml`` (80-230 ms RTT,
100-200 Mbit/s links) run the built-in tiny model as separate processes
through ``isthmus wan up``. Each strategy's tokens per second (of the training
loop, averaged over the sites) is divided by the tokens per second of the
same job with synchronisation switched off (``--strategy none``: the same
processes, the same concurrency). Target (strategies issue): ``async`` or
``streaming`` >= 0.97, reported next to ``sync`` and ``diloco``.

    python benchmarks/strategy_throughput.py [--steps 200] [--sync-every 50]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

from isthmus.deploy.bench_wan import wan_up
from isthmus.deploy.examples.diloco_train import run_sites

EXAMPLE = Path(__file__).resolve().parents[1] / "deploy" / "examples" / "three-continents.yaml"
SITES = ["us-east", "eu-west", "asia-east"]


def run(strategy: list[str], steps: int, sync_every: int) -> float:
    """Mean over the sites of tokens per second of the training loop."""
    with tempfile.TemporaryDirectory(prefix="isthmus-throughput-") as tmp:
        tmpdir = Path(tmp)
        job = tmpdir / "three-continents.yaml"
        shutil.copy(EXAMPLE, job)
        state = tmpdir / "three-continents.wan.json"  # where join() looks
        args = ["--steps", str(steps), "--sync-every", str(sync_every), "--batch", "16"]
        args += ["--threads", "1", "--eval-batches", "1", "--corpus-bytes", "2000000", *strategy]
        with wan_up(job, state, "--stats-every", "0"):
            try:
                reports = run_sites(job, SITES, args, tmpdir, cwd=tmpdir).values()
            except RuntimeError as exc:
                raise SystemExit(f"{strategy}: {exc}") from None
    return statistics.mean(r["tokens_per_s"] for r in reports)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--sync-every", type=int, default=50)
    args = parser.parse_args()
    configs = {
        "none": ["--strategy", "none"],
        "sync": ["--strategy", "sync"],
        "diloco": ["--strategy", "diloco"],
        "streaming": ["--strategy", "streaming", "--fragments", "2", "--overlap-steps", "5"],
        "async": ["--strategy", "async"],
    }
    rates = {}
    for name, flags in configs.items():
        rates[name] = run(flags, args.steps, args.sync_every)
        print(f"{name}: {rates[name]:.0f} tokens/s", file=sys.stderr, flush=True)
    print(f"tokens/s on three continents, {args.steps} steps, H={args.sync_every}, vs no sync:")
    for name, rate in rates.items():
        print(f"  {name:10} {rate:8.0f} tokens/s  {rate / rates['none']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
