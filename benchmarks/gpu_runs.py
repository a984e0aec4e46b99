"""The process-starting pieces of ``benchmarks/gpu.py``: ``isthmus run`` jobs
(write one, run it, read its tokens/s and digests) and a two-process collective.

Also a tiny worker (``python benchmarks/gpu_runs.py collective ...``): one rank
of a two-process all-reduce, for the two-ranks part.
"""

from __future__ import annotations

import json
import socket
import statistics
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from gpu_parts import Context, synchronize


# -- isthmus run -----------------------------------------------------------------------
def write_job(
    path: Path,
    *,
    sites: list[tuple[str, int]],
    ctx: Context,
    steps: int,
    sync_every: int,
    batch_size: int | None = None,
) -> Path:
    """A job file for ``isthmus run``: the built-in model on this device, DiLoCo, int8."""
    lines = [f"name: {path.stem}", "sites:"]
    lines += [f"  - {{name: {name}, ranks: {ranks}}}" for name, ranks in sites]
    lines += [
        f"model: {ctx.model}",
        "train:",
        "  strategy: diloco",
        "  codec: int8",
        f"  steps: {steps}",
        f"  sync_every: {sync_every}",
        f"  batch_size: {batch_size or ctx.batch_size}",
        f"  device: {ctx.device.type}",
        "  precision: bf16",
        f"  compile: {'true' if ctx.compile else 'false'}",
        "  eval_every: 0",  # held-out loss only at the end: none inside the timed steps
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


def isthmus_run(job: Path, out: Path, timeout_s: float) -> dict[str, Any]:
    """``isthmus run JOB --out OUT`` (with its report: the GPU run checks it is written):
    its exit status, summary.json and output's tail."""
    command = [sys.executable, "-m", "isthmus", "run", str(job), "--out", str(out)]
    try:
        done = subprocess.run(
            command, cwd=job.parent, capture_output=True, text=True, timeout=timeout_s
        )
        rc, output = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as expired:
        rc, output = 124, f"timed out after {timeout_s:.0f} s: {expired.stdout or ''}"
    summary_file = out / "summary.json"
    summary = json.loads(summary_file.read_text()) if summary_file.exists() else None
    placement = [line.strip() for line in output.splitlines() if "device:" in line][:1]
    return {
        "command": " ".join(command),
        "rc": rc,
        "summary": summary,
        "placement": placement[0] if placement else None,
        "report_written": (out / "report.md").exists(),
        "tail": output[-3000:],
    }


def steady_tokens_per_s(run_dir: Path, skip: int) -> float:
    """Tokens over time between the step records after the first ``skip`` steps and
    the last one, summed over sites (start-up, warm-up and the final sync left out)."""
    total = 0.0
    for records in sorted((run_dir / "sites").glob("*/metrics.jsonl")):
        steps = []
        for line in records.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:  # a line cut short
                continue
            if record.get("kind") == "step" and record["step"] > skip:
                steps.append(record)
        if len(steps) < 2:
            raise RuntimeError(f"{records}: fewer than 2 step records after step {skip}")
        first, last = steps[0], steps[-1]
        total += (last["tokens"] - first["tokens"]) / (last["t"] - first["t"])
    return total


def one_sha(summary: dict | None) -> tuple[bool, str]:
    """Every site finished and holds the same parameters (one param_sha256)."""
    if not summary:
        return False, "no summary.json"
    sites = summary.get("sites", {})
    unfinished = [name for name, site in sites.items() if site.get("status") != "finished"]
    digests = {site.get("param_sha256") for site in sites.values()}
    ok = summary.get("status") == "finished" and not unfinished and len(digests) == 1
    ok = ok and None not in digests
    detail = f"status {summary.get('status')}, {len(sites)} sites, {len(digests)} digest(s)"
    return ok, detail + (f", unfinished {unfinished}" if unfinished else "")


# -- collectives between two processes ---------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def collective(backend: str, devices: list[str], n: int, workdir: Path) -> dict[str, Any]:
    """An all-reduce of n float32 values between len(devices) processes."""
    out = workdir / f"collective-{backend}-{'-'.join(devices).replace(':', '')}.json"
    port, world = free_port(), len(devices)
    common = [str(port), str(n), str(out)]
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                "collective",
                backend,
                str(rank),
                str(world),
                device,
                *common,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank, device in enumerate(devices)
    ]
    tails = []
    for proc in procs:
        try:
            output, _ = proc.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            proc.kill()
            output, _ = proc.communicate()
            output = "timed out after 180 s\n" + output
        tails.append(output[-1500:])
    if out.exists():
        return json.loads(out.read_text())
    return {"backend": backend, "devices": devices, "error": "\n".join(tails)}


def _collective_worker(argv: list[str]) -> int:
    import torch.distributed as dist

    backend, rank, world, name, port, n, out = argv
    rank, world, count = int(rank), int(world), int(n)
    device = torch.device(name)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=60),
    )
    values = torch.empty(count, device=device)

    def once() -> None:
        values.fill_(rank + 1)
        dist.all_reduce(values)

    once()
    synchronize(device)
    samples = []
    for _ in range(5):
        dist.barrier()
        started = time.perf_counter()
        once()
        synchronize(device)
        samples.append(time.perf_counter() - started)
    correct = bool((values == world * (world + 1) / 2).all())
    seconds = statistics.median(samples)
    if rank == 0:
        figures = {
            "backend": backend,
            "world": world,
            "device_of_rank0": name,
            "values": count,
            "seconds": seconds,
            # bus bandwidth, as nccl-tests reports it for an all-reduce
            "bus_GBps": 4 * count * 2 * (world - 1) / world / seconds / 1e9,
            "correct": correct,
        }
        Path(out).write_text(json.dumps(figures))
    dist.destroy_process_group()
    return 0 if correct else 1


if __name__ == "__main__" and sys.argv[1:2] == ["collective"]:
    raise SystemExit(_collective_worker(sys.argv[2:]))
