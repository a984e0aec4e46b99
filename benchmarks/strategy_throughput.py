"""Training throughput of each strategy on an emulated three-continent WAN, against no sync.

The three sites of ``deploy/examples/three-continents.yaml`` (80-230 ms RTT,
100-200 Mbit/s links) run the built-in tiny model as separate processes
through ``isthmus wan up``. Each strategy's tokens per second (of the training
loop, averaged over the sites) is divided by the tokens per second of the
same job with synchronisation switched off (``--strategy none``: the same
processes, the same concurrency). Target (strategies issue): ``async`` or
``streaming`` >= 0.97, reported next to ``sync`` and ``diloco``.

    python benchmarks/strategy_throughput.py [--steps 200] [--sync-every 50] [--repeats 3]
        [--json FILE]

Each round runs the baseline and every strategy back to back; a strategy's
ratio is against its own round's baseline, and the median over rounds is
reported with every round's ratio.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

from example_sites import run_sites

from isthmus.deploy.bench.emulator_bench import wan_up

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
    parser.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="rounds of runs; each strategy is divided by the no-sync run of its own round",
    )
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    configs = {
        "none": ["--strategy", "none"],
        "sync": ["--strategy", "sync"],
        "diloco": ["--strategy", "diloco"],
        "streaming": ["--strategy", "streaming", "--fragments", "2", "--overlap-steps", "5"],
        "async": ["--strategy", "async"],
    }
    # This machine's speed drifts over minutes: each round runs the baseline and
    # every strategy back to back, and a strategy's ratio is taken against its
    # own round's baseline; the median over rounds is reported.
    rates: dict[str, list[float]] = {name: [] for name in configs}
    ratios: dict[str, list[float]] = {name: [] for name in configs if name != "none"}
    for repeat in range(args.repeats):
        for name, flags in configs.items():
            rates[name].append(run(flags, args.steps, args.sync_every))
            print(
                f"round {repeat + 1}/{args.repeats}: {name}: {rates[name][-1]:.0f} tokens/s",
                file=sys.stderr,
                flush=True,
            )
        for name in ratios:
            ratios[name].append(rates[name][-1] / rates["none"][-1])
    print(
        f"tokens/s on three continents, {args.steps} steps, H={args.sync_every}, vs no sync "
        f"in the same round (median of {args.repeats} rounds; every round's ratio):"
    )
    print(f"  {'none':10} {statistics.median(rates['none']):8.0f} tokens/s")
    for name, values in ratios.items():
        listed = ", ".join(f"{v:.3f}" for v in values)
        print(
            f"  {name:10} {statistics.median(rates[name]):8.0f} tokens/s  "
            f"{statistics.median(values):.3f}  ({listed})"
        )
    if args.json:
        figures = {
            "steps": args.steps,
            "sync_every": args.sync_every,
            "tokens_per_s": rates,
            "ratio_to_no_sync": ratios,
            "median_ratio": {name: statistics.median(v) for name, v in ratios.items()},
        }
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
