"""Compute time of one inner step on this machine, measured at a job's concurrency.

Several site processes share this machine's cores in an emulated run, so a
step measured alone is faster than a step in the run. The calibration starts
as many processes as the job has ranks, each with the thread count
``isthmus run`` gives it, all training the job's model on its data at once
(no WAN), and takes the median step time over all of them.
"""

from __future__ import annotations

import multiprocessing
import os
import statistics
import time
from pathlib import Path

WARMUP_STEPS = 5


def _worker(
    job_path: str, batch_size: int, steps: int, threads: int, start_at: float
) -> list[float]:
    import torch

    from isthmus.deploy.jobfile import load_job
    from isthmus.deploy.run_worker import build_model, builtin_dataset
    from isthmus.intra.data import ShardSpec

    torch.set_num_threads(threads)
    job = load_job(job_path)
    model, _, loss_fn = build_model(job)
    dataset = builtin_dataset(job, model)
    if dataset is None:
        raise ValueError("calibration needs the built-in data path; give --step-ms instead")
    batches = dataset.batches(ShardSpec(0, (1,), 0), batch_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    while time.time() < start_at:  # every process measures the same stretch of time
        time.sleep(0.01)
    times = []
    for i in range(WARMUP_STEPS + steps):
        started = time.perf_counter()
        x, y = next(batches)
        loss_fn(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        if i >= WARMUP_STEPS:
            times.append(time.perf_counter() - started)
    return times


def step_seconds(job_path: Path, *, ranks: int, batch_size: int, steps: int = 30) -> float:
    """Median seconds of a step with ``ranks`` processes training at once."""
    threads = max(1, (os.cpu_count() or 1) // ranks)
    context = multiprocessing.get_context("spawn")
    start_at = time.time() + 8.0  # time for every process to import torch and build
    with context.Pool(ranks) as pool:
        results = pool.starmap(
            _worker, [(str(job_path), batch_size, steps, threads, start_at)] * ranks
        )
    return statistics.median(t for times in results for t in times)
