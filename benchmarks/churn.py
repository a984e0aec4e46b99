"""Goodput under churn: a job of several sites, one of them killed every T seconds.

``python benchmarks/faults.py churn`` (this module's :func:`churn`) runs the same
job twice for ``--minutes``:

1. with no failures, stopped once the time is up: the tokens its sites train in
   that time are the reference;
2. with ``isthmus run --restart-lost``, SIGKILLing a random live site every
   ``--kill-every-s`` seconds (as a lost machine would), each restarted by the
   launcher and let back in by the others; after the time is up the kills stop
   and the run trains to its end (a quarter more steps than the reference
   reached), so it ends as a run does (final synchronisation, every site's
   ``param_sha256``).

Reported: goodput (tokens trained in the stated time that count, over the
reference's), the tokens a killed site had trained since its last round (lost
with it), rounds given up (views that made the members run the round under way
again), the longest stall (the longest time a running site took no step), and
whether every site ended with the same model and every victim was let back in.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import itertools
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from isthmus.job.broker import Broker
from isthmus.training.records import read_records

JOB = """\
name: churn
sites:
{sites}
wan:
  default: {{rtt_ms: {rtt_ms}, bandwidth_mbit: {bandwidth_mbit}}}
train:
  strategy: diloco
  steps: {steps}
  sync_every: {sync_every}
  warmup_steps: 2
  min_sites: {min_sites}
"""

SITE_NAMES = (
    *("us-east", "eu-west", "asia-east", "us-west", "sa-east", "af-south"),
    *(f"s{i:02d}" for i in range(6, 16)),
)
"""Up to 16 sites (issue 32's scale): six named, then numbered."""


def job_text(args: argparse.Namespace, steps: int) -> str:
    sites = "\n".join(f"  - {{name: {n}, ranks: 1}}" for n in SITE_NAMES[: args.sites])
    return JOB.format(
        sites=sites,
        rtt_ms=args.rtt_ms,
        bandwidth_mbit=args.bandwidth_mbit,
        steps=steps,
        sync_every=args.sync_every,
        min_sites=args.min_sites,
    )


def _say(message: str) -> None:
    print(f"faults churn: {message}", file=sys.stderr, flush=True)


def _start(job: Path, out: Path, *flags: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "isthmus",
            "run",
            str(job),
            "--out",
            str(out),
            "--no-report",
            *flags,
        ],
        cwd=job.parent,  # the run writes ./JOB.control.json for `isthmus config`
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def _site_records(out: Path, site: str) -> list[dict[str, Any]]:
    path = out / "sites" / site / "metrics.jsonl"
    return read_records(path) if path.exists() else []


def _first_step_t(out: Path, sites: list[str]) -> float | None:
    """When every site had taken its first step (the clock starts there, for both runs)."""
    firsts = []
    for site in sites:
        step = next((r["t"] for r in _site_records(out, site) if r["kind"] == "step"), None)
        if step is None:
            return None
        firsts.append(step)
    return max(firsts)


def _wait_for_training(out: Path, sites: list[str], run: subprocess.Popen[str]) -> float:
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        started = _first_step_t(out, sites)
        if started is not None:
            return started
        if run.poll() is not None:
            raise RuntimeError(f"the run ended before training: {run.stderr.read()[-2000:]}")
        time.sleep(0.2)
    raise TimeoutError("the sites did not start training within 600 s")


def _segments(records: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """A site's records split by process: each ``start`` record begins a new one."""
    segments: list[list[dict[str, Any]]] = []
    for r in records:
        if r["kind"] == "start" or not segments:
            segments.append([])
        segments[-1].append(r)
    return segments


def tokens_in_window(out: Path, sites: list[str], t0: float, t1: float) -> dict[str, Any]:
    """Tokens the sites trained between ``t0`` and ``t1``, and those that did not
    count: a process's steps after its last completed round, when it was killed
    (its pseudo-gradient died with it)."""
    trained = lost = 0
    stall = 0.0
    for site in sites:
        segments = _segments(_site_records(out, site))
        for number, segment in enumerate(segments):
            steps = [r for r in segment if r["kind"] == "step" and t0 <= r["t"] <= t1]
            if not steps:
                continue
            per_step = _tokens_per_step(segment)
            trained += len(steps) * per_step
            killed = number < len(segments) - 1 and not any(
                r["kind"] == "state" and r.get("state") in ("finished", "left") for r in segment
            )
            if killed:
                last_round = max((r["t"] for r in segment if r["kind"] == "round"), default=0.0)
                lost += sum(per_step for r in steps if r["t"] > last_round)
            times = [r["t"] for r in steps]
            stall = max([stall, *(b - a for a, b in itertools.pairwise(times))])
    return {"trained": trained, "lost": lost, "longest_stall_s": stall}


def _tokens_per_step(segment: list[dict[str, Any]]) -> int:
    """One step's tokens in a process (its step records count them cumulatively)."""
    steps = [r for r in segment if r["kind"] == "step"]
    if len(steps) > 1:
        return (steps[-1]["tokens"] - steps[0]["tokens"]) // (len(steps) - 1)
    return steps[0]["tokens"]


def reference(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """The job with no failures for the stated time; then stopped."""
    job = tmp / "reference.yaml"
    job.write_text(job_text(args, steps=1_000_000))
    out = tmp / "reference"
    sites = list(SITE_NAMES[: args.sites])
    run = _start(job, out)
    try:
        t0 = _wait_for_training(out, sites, run)
        _say(f"reference: training; {args.minutes:g} min with no failures")
        _progress_until(t0 + args.minutes * 60, out, sites)
    finally:
        run.send_signal(signal.SIGTERM)
        run.communicate(timeout=120)
    window = tokens_in_window(out, sites, t0, t0 + args.minutes * 60)
    steps = max(
        (r["step"] for s in sites for r in _site_records(out, s) if r["kind"] == "step"),
        default=0,
    )
    stall = window["longest_stall_s"]
    return {"tokens": window["trained"], "steps": steps, "longest_stall_s": stall}


def _progress_until(end: float, out: Path, sites: list[str], every_s: float = 30.0) -> None:
    next_say = time.time() + every_s
    while time.time() < end:
        time.sleep(min(1.0, max(0.0, end - time.time())))
        if time.time() >= next_say:
            next_say += every_s
            steps = {
                s: max((r["step"] for r in _site_records(out, s) if r["kind"] == "step"), default=0)
                for s in sites
            }
            _say(f"{(end - time.time()) / 60:.1f} min left; steps {steps}")


class BrokerTally:
    """Every message the run's broker delivers to one more subscriber of ``isthmus/#``
    (each message once), counted by second and by topic (statuses, the membership
    views, metrics, live settings): the control plane's load at this many sites."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.per_second: collections.Counter[int] = collections.Counter()
        self.by_topic: collections.Counter[str] = collections.Counter()
        self.problem = ""
        self._loop = asyncio.new_event_loop()
        self._task: asyncio.Task[None] | None = None
        self._thread = threading.Thread(target=self._run, name="broker-tally", daemon=True)

    def start(self) -> BrokerTally:
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._task is not None:
            self._loop.call_soon_threadsafe(self._task.cancel)
        self._thread.join(10)

    def _run(self) -> None:
        self._task = self._loop.create_task(self._count())
        try:
            self._loop.run_until_complete(self._task)
        except asyncio.CancelledError:
            pass
        except Exception as exc:  # the figures say the tally failed, and why
            if not (self.run_dir / "summary.json").exists():  # else: the broker ended with the run
                self.problem = f"{type(exc).__name__}: {exc}"

    async def _count(self) -> None:
        control = self.run_dir / "control.json"
        while not control.exists():
            await asyncio.sleep(0.2)
        broker = Broker.from_url(json.loads(control.read_text())["broker"])
        async with broker.client(f"isthmus-broker-tally-{os.getpid()}") as client:
            await client.subscribe("isthmus/#")
            async for message in client.messages:
                self.per_second[int(time.time())] += 1
                # isthmus/JOB/sites/SITE/status, isthmus/JOB/metrics/SITE,
                # isthmus/JOB/membership, isthmus/JOB/config
                parts = str(message.topic).split("/")
                self.by_topic[parts[-1] if parts[2] == "sites" else parts[2]] += 1

    def figures(self, t0: float, t1: float) -> dict[str, Any]:
        """Messages per second between ``t0`` and ``t1`` (mean and busiest second)."""
        window = {t: n for t, n in self.per_second.items() if t0 <= t < t1}
        seconds = max(1.0, t1 - t0)
        return {
            "messages": sum(self.per_second.values()),
            "by_topic": dict(self.by_topic),
            "per_second_mean": round(sum(window.values()) / seconds, 1),
            "per_second_peak": max(window.values(), default=0),
            "problem": self.problem,
        }


def churned(args: argparse.Namespace, tmp: Path, steps: int) -> dict[str, Any]:
    """The job with a random live site SIGKILLed every ``--kill-every-s`` seconds."""
    job = tmp / "churn.yaml"
    job.write_text(job_text(args, steps=steps))
    out = tmp / "churn"
    sites = list(SITE_NAMES[: args.sites])
    rng = random.Random(args.seed)
    kills: list[dict[str, Any]] = []
    run = _start(job, out, "--restart-lost")
    tally = BrokerTally(out).start()
    try:
        t0 = _wait_for_training(out, sites, run)
        end = t0 + args.minutes * 60
        _say(f"training; a site killed every {args.kill_every_s:g} s for {args.minutes:g} min")
        while (next_kill := t0 + args.kill_every_s * (len(kills) + 1)) < end:
            _progress_until(next_kill, out, sites)
            if run.poll() is not None:
                break
            victim = _kill_a_live_site(out, sites, rng)
            if victim is not None:
                kills.append({"site": victim, "t": time.time() - t0})
                _say(f"killed {victim} ({len(kills)} so far)")
        _progress_until(end, out, sites)
        _say("time is up: no more kills; the run trains to its end")
        _, err = run.communicate(timeout=args.minutes * 60 + 900)
    finally:
        run.kill()
        tally.stop()
    summary = json.loads((out / "summary.json").read_text())
    window = tokens_in_window(out, sites, t0, end)
    records = read_records(out / "metrics.jsonl")
    rejoins = [r["site"] for r in records if r["kind"] == "rejoin"]
    views = {r["epoch"]: r for r in records if r["kind"] == "view"}
    given_up = [
        v
        for v in views.values()
        if any(word in v["reason"] for word in ("left out", "restarted", "stuck"))
    ]
    digests = {n: s.get("param_sha256") for n, s in summary["sites"].items()}
    return {
        "exit_status": run.returncode,
        "status": summary["status"],
        "tokens": window["trained"],
        "tokens_lost_with_killed_sites": window["lost"],
        "kills": kills,
        "rejoins": len(rejoins),
        "every_victim_let_back_in": len(rejoins) >= len(kills),
        "rounds_given_up": len(given_up),
        "views": len(views),
        "longest_stall_s": round(window["longest_stall_s"], 1),
        "same_model_on_every_site": len(set(digests.values())) == 1 and None not in digests,
        "site_status": {n: s.get("status") for n, s in summary["sites"].items()},
        "broker": tally.figures(t0, end),
        "stderr_tail": err[-1000:] if run.returncode else "",
    }


def _kill_a_live_site(out: Path, sites: list[str], rng: random.Random) -> str | None:
    """SIGKILL every process of a random running site: all its processes alive and
    training (a site still restarting or pulling the state is not picked)."""
    pids = json.loads((out / "pids.json").read_text())
    running = []
    for site in sites:
        segments = _segments(_site_records(out, site))
        trains = bool(segments) and any(r["kind"] == "step" for r in segments[-1])
        if trains and all(_running(p) for p in pids.get(site, [])):
            running.append(site)
    if not running:
        return None
    victim = rng.choice(running)
    for pid in pids[victim]:
        os.kill(pid, signal.SIGKILL)
    return victim


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def churn(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="isthmus-churn-") as name:
        tmp = Path(name)
        ref = reference(args, tmp)
        # More steps than the reference trained in the time, so that the churned run
        # (which may go faster: a killed site leaves its cores to the others on a
        # machine this small) still trains through the whole window; past it, no
        # more kills, and it trains to its end for the final agreement check.
        run = churned(args, tmp, steps=int(ref["steps"] * 1.25) + args.sync_every)
    goodput = (run["tokens"] - run["tokens_lost_with_killed_sites"]) / ref["tokens"]
    return {
        "sites": args.sites,
        "minutes": args.minutes,
        "kill_every_s": args.kill_every_s,
        "goodput": round(goodput, 3),
        "reference_tokens": ref["tokens"],
        "reference_longest_stall_s": round(ref["longest_stall_s"], 1),
        **run,
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sites", type=int, default=4, choices=range(2, len(SITE_NAMES) + 1))
    parser.add_argument("--minutes", type=float, default=10.0, help="the stated time")
    parser.add_argument("--kill-every-s", type=float, default=60.0, help="T: one kill per T s")
    parser.add_argument("--min-sites", type=int, default=2, help="the job's quorum")
    parser.add_argument("--sync-every", type=int, default=20)
    parser.add_argument("--rtt-ms", type=float, default=40.0)
    parser.add_argument("--bandwidth-mbit", type=float, default=200.0)
    parser.add_argument("--seed", type=int, default=0, help="which sites are killed")
    parser.add_argument("--json", type=Path, help="also write the figures here")


def passed(figures: dict[str, Any]) -> bool:
    return (
        figures["status"] == "finished"
        and figures["same_model_on_every_site"]
        and figures["every_victim_let_back_in"]
    )
