"""Kill a site of a running ``isthmus run`` and measure what follows.

Shared by the fault benchmark (``benchmarks/faults.py kill``) and the tests:
:func:`kill_after_rounds` waits until a site has completed some rounds, then
SIGKILLs its processes (as a crash or a lost machine would), and
:func:`loss_figures` reads the run's records for what the failure-handling
issue measures: how soon the survivors completed a round after the kill, and
how soon the restarted site was training again, against a round's duration
plus the state transfer.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import statistics
import time
from pathlib import Path
from typing import Any

from isthmus.training.records import read_records


def kill_after_rounds(
    run_dir: Path,
    site: str,
    rounds: int,
    timeout_s: float = 600,
    sig: int = signal.SIGKILL,
    ranks: list[int] | None = None,
) -> float:
    """SIGKILL ``site``'s processes (``ranks``: only those) once it has recorded
    ``rounds`` rounds, or send them ``sig``; returns the time of the kill
    (``time.time()``)."""
    metrics = run_dir / "sites" / site / "metrics.jsonl"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if metrics.exists():
            done = sum(1 for r in read_records(metrics) if r["kind"] == "round")
            if done >= rounds:
                pids = json.loads((run_dir / "pids.json").read_text())[site]
                if ranks is not None:
                    pids = [pids[r] for r in ranks]
                killed = time.time()
                for pid in pids:
                    os.kill(pid, sig)
                return killed
        time.sleep(0.1)
    raise TimeoutError(f"site {site} did not reach {rounds} rounds within {timeout_s:g} s")


def loss_figures(run_dir: Path, victim: str, killed: float) -> dict[str, Any]:
    """What followed the kill of ``victim`` at ``killed``, from the run's records."""
    records = read_records(run_dir / "metrics.jsonl")
    by_site: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        if r.get("site"):
            by_site.setdefault(r["site"], []).append(r)
    survivors = [s for s in by_site if s != victim]
    # The first round the survivors completed that the victim never did (a round
    # the victim finished just before it died may be recorded just after).
    victim_rounds = max(
        (
            r["outer_steps"]
            for r in by_site.get(victim, [])
            if r["kind"] == "round" and r["t"] <= killed
        ),
        default=0,
    )
    next_round = {
        s: min(
            (
                r["t"] - killed
                for r in by_site[s]
                if r["kind"] == "round" and r["outer_steps"] > victim_rounds
            ),
            default=None,
        )
        for s in survivors
    }
    round_times = sorted(r["t"] for r in by_site[survivors[0]] if r["kind"] == "round")
    before = [b - a for a, b in itertools.pairwise(round_times) if b < killed]
    round_s = statistics.median(before) if before else None
    mine = by_site.get(victim, [])
    restarted = next((r["t"] for r in mine if r["kind"] == "start" and r["t"] > killed), None)
    rejoin = next((r for r in mine if r["kind"] == "rejoin"), None)
    back_s = rejoin["t"] - restarted if rejoin and restarted else None
    views = [
        {k: r[k] for k in ("epoch", "members", "start_round", "reason")}
        for r in by_site[survivors[0]]
        if r["kind"] == "view"
    ]
    return {
        "survivors_next_round_after_kill_s": next_round,
        "round_s_before_kill": round_s,
        "victim_restarted_after_kill_s": None if restarted is None else restarted - killed,
        "victim_back_in_training_after_restart_s": back_s,
        "state_transfer_s": rejoin["seconds"] if rejoin else None,
        "state_transfer_bytes": rejoin["bytes"] if rejoin else None,
        "rejoined_at_round": rejoin["round"] if rejoin else None,
        "views": views,
    }
