"""How long ``isthmus --help`` takes, and that it loads neither torch nor gRPC.

    python benchmarks/cli_startup.py [--runs 21]

Prints the median and the spread of the wall time of ``isthmus --help`` (the
console script, a new process each run) and which heavy modules it imported
(from ``-X importtime``). Target: median <= 0.3 s, no torch, no grpc.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import time

HEAVY = ("torch", "grpc", "aiomqtt", "paho", "zstandard")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=21)
    args = parser.parse_args()
    command = [shutil.which("isthmus") or "isthmus", "--help"]
    times = []
    for _ in range(args.runs):
        started = time.perf_counter()
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
        times.append(time.perf_counter() - started)
    traced = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "isthmus", "--help"],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    loaded = {
        line.rsplit("|", 1)[-1].strip().split(".")[0]
        for line in traced.stderr.splitlines()
        if line.startswith("import time:")
    }
    heavy = sorted(m for m in HEAVY if m in loaded)
    quartiles = statistics.quantiles(times, n=4)
    print(
        f"isthmus --help: median {statistics.median(times):.3f} s over {args.runs} runs "
        f"(quartiles {quartiles[0]:.3f}-{quartiles[2]:.3f} s); heavy modules loaded: "
        f"{', '.join(heavy) or 'none'}"
    )
    return 0 if not heavy else 1


if __name__ == "__main__":
    raise SystemExit(main())
