"""The strategies' overhead on inner steps that do not synchronise (target <= 1% of step time).

One site (a one-site job: nothing crosses a WAN), the built-in tiny model,
batch 16 x 64. Steps with a strategy hooked to the optimizer (its round never
comes: ``sync_every`` is larger than the run) alternate with steps of the bare
loop, in blocks, so both see the same machine; reported: median step times
and their ratio.

    python benchmarks/strategy_overhead.py [--steps 200]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

import isthmus
from isthmus.inter.allocator import keep_freed_memory
from isthmus.intra.data import Dataset, ShardSpec, stdlib_corpus
from isthmus.intra.model import GPT, config_for, lm_loss
from isthmus.job.file import free_port_blocks


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--block", type=int, default=10, help="steps per alternation")
    args = parser.parse_args()
    torch.set_num_threads(1)
    keep_freed_memory()  # as the launchers do for their ranks (see isthmus.inter.allocator)
    with tempfile.TemporaryDirectory() as tmp:
        (base,) = free_port_blocks("127.0.0.1", [1])
        job = Path(tmp, "job.yaml")
        job.write_text(f"name: overhead\nsites: [{{name: a, address: '127.0.0.1:{base}'}}]\n")
        site = isthmus.join(job, site="a")
        torch.manual_seed(0)
        model = GPT(config_for("tiny"))
        data = Dataset(stdlib_corpus(2_000_000), model.config.seq_len)
        batches = data.batches(ShardSpec(0, (1,), 0), 16)
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)

        def step() -> float:
            x, y = next(batches)
            started = time.perf_counter()
            lm_loss(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
            return time.perf_counter() - started

        for _ in range(5):  # warm-up
            step()
        never = 10**9  # the round never comes: only the per-step hook runs
        factories = {
            "bare": None,
            "DiLoCo": lambda: isthmus.DiLoCo(site, model, optimizer, sync_every=never),
            "StreamingDiLoCo": lambda: isthmus.StreamingDiLoCo(
                site, model, optimizer, sync_every=never, fragments=2
            ),
            "AsyncDiLoCo": lambda: isthmus.AsyncDiLoCo(site, model, optimizer, sync_every=never),
        }
        timings: dict[str, list[float]] = {name: [] for name in factories}
        for _ in range(args.steps // args.block):
            for name, make in factories.items():
                strategy = make() if make is not None else None
                timings[name] += [step() for _ in range(args.block)]
                if strategy is not None:
                    strategy.close()  # unhook, without a final round
        site.close()
    bare = statistics.median(timings["bare"])
    print(f"median step, tiny model, batch 16 x 64, {args.steps} steps each, one thread:")
    for name, samples in timings.items():
        median = statistics.median(samples)
        print(
            f"  {name:16} {median * 1e3:8.2f} ms  ({median / bare - 1:+.2%} vs bare; target <= +1%)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
