"""The in-site half of the hierarchical step over Gloo on this machine: what ``isthmus sim``
charges a multi-rank site of an emulated job.

    python benchmarks/in_site_fabric.py [--ranks 2] [--busy 2] [--repeats 60] [--json]

A site of ``--ranks`` ranks (one process each, one thread, as ``isthmus run``
starts them) runs the hierarchical step's in-site collectives, a
reduce-scatter then an all-gather, on float32 vectors of 2 values (the
latency), of the tiny model (470,784 values) and of four times that. Each
call starts after a barrier, and the figure is rank 0's median, so it is
the collectives' own time, not a wait for a rank still computing (the
median over ranks of ``benchmarks/hierarchical_step.py`` includes that
wait: 18-42 ms, which the model once took for the fabric's speed).
``--busy N`` keeps N more processes spinning meanwhile, as an emulated run's
other sites and its emulator do.

It prints the latency per collective, the bytes per second of the fit
``2 (d - 1) / d x bytes / rate + 2 (d - 1) x latency`` (the model's in-site
term, ``isthmus.sim.perf_model.exchange_cost``) through the two larger sizes,
and the constants ``deploy/cli/sim_scenario.py`` holds for them.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import time
import warnings

from isthmus.job.ports import free_port

SIZES = (1, 470_784, 4 * 470_784)
"""Values per rank's shard times the ranks (so any rank count divides them): one (the
latency), the tiny model, and four times it."""


def _rank(rank: int, ranks: int, port: int, repeats: int, out) -> None:
    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore", category=FutureWarning)  # all_gather_into_tensor's rename
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=ranks)
    medians = {}
    for size in (per_rank * ranks for per_rank in _shards(ranks)):
        values = torch.randn(size)
        shard, whole = torch.empty(size // ranks), torch.empty(size)
        times = []
        for _ in range(repeats):
            dist.barrier()
            started = time.perf_counter()
            dist.reduce_scatter_tensor(shard, values)
            dist.all_gather_into_tensor(whole, shard)
            times.append(time.perf_counter() - started)
        medians[len(medians)] = statistics.median(times[5:])  # first calls set up buffers
    dist.destroy_process_group()
    if rank == 0:
        out.put(medians)


def _shards(ranks: int) -> list[int]:
    """Each rank's shard of every size in :data:`SIZES` (rounded up)."""
    return [-(-size // ranks) for size in SIZES]


def _spin(stop) -> None:
    while not stop.is_set():
        pass


def measure(ranks: int, busy: int, repeats: int) -> dict:
    context = multiprocessing.get_context("spawn")
    stop, out = context.Event(), context.Queue()
    spinners = [context.Process(target=_spin, args=(stop,)) for _ in range(busy)]
    for p in spinners:
        p.start()
    try:
        port = free_port("127.0.0.1")
        procs = [
            context.Process(target=_rank, args=(r, ranks, port, repeats, out)) for r in range(ranks)
        ]
        for p in procs:
            p.start()
        medians = out.get(timeout=600)
        for p in procs:
            p.join()
    finally:
        stop.set()
        for p in spinners:
            p.join()
    # Two collectives, each (d - 1) latencies: 2 (d - 1) in all, as the model counts.
    hops = 2 * (ranks - 1)
    latency = medians[0] / hops
    share = 2 * (ranks - 1) / ranks
    sizes = [per_rank * ranks for per_rank in _shards(ranks)]
    rate = share * 4 * (sizes[2] - sizes[1]) / (medians[2] - medians[1])
    return {
        "ranks": ranks,
        "busy_processes": busy,
        "seconds_by_values": {str(size): medians[i] for i, size in enumerate(sizes)},
        "latency_s": latency,
        "bytes_per_s": rate,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--busy", type=int, default=2, help="spinning processes beside them")
    parser.add_argument("--repeats", type=int, default=60)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.ranks < 2:
        parser.error("--ranks: a site of one rank has no in-site step; give 2 or more")
    if args.busy < 0 or args.repeats < 10:
        parser.error("--busy must be >= 0 and --repeats >= 10")
    result = measure(args.ranks, args.busy, args.repeats)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    for size, seconds in result["seconds_by_values"].items():
        print(
            f"{int(size):>9,} values: reduce-scatter + all-gather {seconds * 1e3:.2f} ms (median)"
        )
    print(
        f"{args.ranks} ranks beside {args.busy} busy processes: latency "
        f"{result['latency_s'] * 1e3:.3f} ms per hop (the model counts 2 (d - 1) of them), "
        f"{result['bytes_per_s'] / 1e6:.0f} MB/s"
    )
    print(
        "deploy/cli/sim_scenario.py: GLOO_LOOPBACK_BYTES_PER_S, GLOO_LOOPBACK_LATENCY_S "
        "(an emulated job's in-site step)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
