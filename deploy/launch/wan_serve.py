"""Serving an emulated WAN in this process: one proxy link (``isthmus wan proxy``) or a
job's whole topology on loopback proxies (``isthmus wan up``); the packet-level
backend is :mod:`isthmus.deploy.launch.wan_hosts`. Each serves until SIGINT or
SIGTERM, then prints its counters."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from pathlib import Path

from isthmus.deploy.usage import UsageError
from isthmus.job.file import Job
from isthmus.job.link import describe_link
from isthmus.sim.emulator import Emulator
from isthmus.sim.emulator_control import ControlServer, format_stats
from isthmus.sim.topology import Topology
from isthmus.training.records import write_json_atomic

STATE_VERSION = 1
"""The version of the state file ``isthmus wan up`` writes (what to dial, where its
control service listens)."""


async def serve_proxy(topology: Topology, listen: tuple[str, int], connect: tuple[str, int]) -> int:
    stop = stop_on_signals()
    emulator = Emulator(topology, listen={("client", "server", 0): listen})
    try:
        await emulator.start()
    except OSError as exc:
        raise UsageError(f"--listen: {exc.strerror}") from None
    if not await reachable(connect):
        print(
            f"warning: --connect {connect[0]}:{connect[1]} is not reachable yet; "
            "connections will be closed until it is",
            file=sys.stderr,
        )
    params = topology.link_params("client", "server")
    print(
        f"ready: {listen[0]}:{listen[1]} -> {connect[0]}:{connect[1]} "
        f"({describe_link(params.a_to_b, params.rtt_ms)})",
        flush=True,
    )
    await stop.wait()
    counters = emulator.stats()["links"][0]
    await emulator.stop()
    for direction, label in (("client->server", "to upstream"), ("server->client", "to client")):
        c = counters[direction]
        print(
            f"{label}: bytes={c['bytes']} segments={c['segments']} "
            f"segments_delayed={c['segments_delayed']} lost_segments={c['lost_segments']} "
            f"stalls={c['stalls']} corrupted_bytes={c['corrupted_bytes']} "
            f"connections={c['connections']} resets={c['resets']} "
            f"disconnects={c['disconnects']} upstream_failures={c['upstream_failures']}",
            flush=True,
        )
    return 0


async def reachable(address: tuple[str, int]) -> bool:
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(*address), timeout=2)
    except (TimeoutError, OSError):
        return False
    writer.close()
    return True


def stop_on_signals() -> asyncio.Event:
    """An event set by SIGINT or SIGTERM. Install it before printing "ready", so a
    signal sent as soon as the line is seen still shuts down cleanly."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    return stop


async def serve_topology(job: Job, state_path: Path, host: str, stats_every: float) -> int:
    stop = stop_on_signals()
    ranks = job.rank_addresses(host)
    emulator = Emulator(Topology.for_job(job, ranks), host=host)
    try:
        await emulator.start()
    except OSError as exc:
        raise UsageError(str(exc.strerror)) from None
    control = ControlServer(emulator, host="127.0.0.1", progress=emulator.progress)
    control_address = await control.start()
    state = {
        "version": STATE_VERSION,
        "job": job.name,
        "backend": "proxy",
        "pid": os.getpid(),
        "control": "{}:{}".format(*control_address),
        "sites": {
            s.name: {
                "ranks": s.ranks,
                "listen": ["{}:{}".format(*a) for a in ranks[s.name]],
                "dial": emulator.dial_map()[s.name],
            }
            for s in job.sites
        },
    }
    write_json_atomic(state_path, state)
    topology = emulator.topology
    for a, b in topology.pairs():
        p = topology.link_params(a, b)
        print(f"link {a}<->{b}: {describe_link(p.a_to_b, p.rtt_ms)}")
    for name, site in state["sites"].items():
        print(f"site {name}: ranks listen on {', '.join(site['listen'])}")
    print(f"ready: {len(topology.pairs())} links up; addresses to dial in {state_path}", flush=True)
    reporter = asyncio.ensure_future(_report_throughput(emulator, stats_every))
    try:
        await stop.wait()
    finally:
        reporter.cancel()
        stats = emulator.stats()
        await control.stop()
        await emulator.stop()
        with contextlib.suppress(FileNotFoundError):
            state_path.unlink()
    print(format_stats(stats), flush=True)
    return 0


async def _report_throughput(emulator: Emulator, every_s: float) -> None:
    """Print, every ``every_s``, the throughput of each link direction that carried bytes."""
    if every_s <= 0:
        return
    last: dict[tuple[str, str], int] = {}
    while True:
        await asyncio.sleep(every_s)
        busy = []
        for link in emulator.links.values():
            for d in (link.a_to_b, link.b_to_a):
                sent = d.counters.bytes - last.get((d.src, d.dst), 0)
                last[(d.src, d.dst)] = d.counters.bytes
                if sent:
                    busy.append(f"{d.src}->{d.dst} {sent * 8 / every_s / 1e6:.1f} Mbit/s")
        if busy:
            print("traffic: " + ", ".join(busy), flush=True)
