"""What starting a rank costs, and what forking ranks from a warm template would save.

Each rank of ``isthmus run`` is a fresh interpreter that imports torch, builds the
model on the meta device, materialises it and builds its optimizer (which
imports torch._dynamo) before its first step. This measures N such ranks started
as fresh interpreters against N forked from one process that has done the
imports already (the design a launcher-side template would follow), median of
``--trials``, wall time and CPU time of the whole tree.

    python benchmarks/rank_startup.py --ranks 3 --trials 3
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time


def rank_work() -> None:
    """What a rank does before its first step that is not talking to its peers."""
    import torch

    from isthmus.intra.parallelize import materialise
    from isthmus.job.file import parse_job
    from isthmus.training.rank_setup import build_model

    job = parse_job("name: probe\nsites: [{name: a}, {name: b}]\n")
    model, _, _ = build_model(job, on_meta=True)
    materialise(model, torch.device("cpu"), 0)
    torch.optim.AdamW(model.parameters())


def cpu_seconds() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def trial(mode: str, ranks: int) -> tuple[float, float]:
    """One trial in a process of its own, so that its CPU count starts at zero."""
    done = subprocess.run(
        [sys.executable, __file__, "--trial", mode, "--ranks", str(ranks)],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    wall, cpu = done.stdout.split()
    return float(wall), float(cpu)


def run_trial(mode: str, ranks: int) -> None:
    started = time.perf_counter()
    if mode == "fresh":
        procs = [subprocess.Popen([sys.executable, __file__, "--rank"]) for _ in range(ranks)]
        for proc in procs:
            proc.wait()
    else:  # the template imports once; the ranks are forked from it
        import torch._dynamo  # noqa: F401 - what any optimizer's constructor imports

        import isthmus.training.rank_setup
        import isthmus.training.worker  # noqa: F401

        pids = []
        for _ in range(ranks):
            pid = os.fork()
            if pid == 0:
                rank_work()
                os._exit(0)
            pids.append(pid)
        for pid in pids:
            os.waitpid(pid, 0)
    print(f"{time.perf_counter() - started:.3f} {cpu_seconds():.3f}")


def main() -> int:
    parser = argparse.ArgumentParser(prog="python benchmarks/rank_startup.py")
    parser.add_argument("--ranks", type=int, default=3)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--trial", choices=["fresh", "forked"], help=argparse.SUPPRESS)
    parser.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank:
        rank_work()
        return 0
    if args.trial:
        run_trial(args.trial, args.ranks)
        return 0
    if args.ranks < 1 or args.trials < 1:
        parser.error("--ranks and --trials: give integers >= 1")
    for mode in ("fresh", "forked"):
        results = []
        for i in range(args.trials):
            results.append(trial(mode, args.ranks))
            print(f"{mode} trial {i + 1}/{args.trials}: {results[-1][0]:.2f} s", file=sys.stderr)
        wall = statistics.median(r[0] for r in results)
        cpu = statistics.median(r[1] for r in results)
        said = f"{args.ranks} ranks {mode}: {wall:.2f} s wall, {cpu:.1f} CPU-s"
        print(f"{said} (median of {args.trials})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
