"""``isthmus wan up --hosts`` and ``isthmus wan exec``: every site a separate emulated host.

The process that runs ``wan up --hosts`` *is* the router: it creates one
network namespace and TUN device per site, routes every packet between them
through the emulated links until SIGINT/SIGTERM, and then removes everything
it made. A router killed outright leaves namespaces behind; the next
``wan up --hosts`` of the job removes them.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from isthmus.deploy.usage import UsageError
from isthmus.job.file import Job
from isthmus.sim.emulator_control import ControlServer
from isthmus.sim.fault_runner import Progress, run_fault
from isthmus.sim.hosts import (
    MIN_TCP_RMEM_MAX,
    TCP_BUFFER_MAX,
    Hosts,
    HostsUnavailable,
    check_support,
    netns_name,
)
from isthmus.sim.router import Router
from isthmus.sim.topology import Topology

DEFAULT_PORT = 7100
"""Where rank 0 of a site listens on its host when the job file gives no address."""


def check_tcp_rmem_max(value: int, *, hosts: bool) -> None:
    """The ``--tcp-rmem-max`` flag of ``wan up`` and ``bench allreduce``, checked."""
    if not hosts:
        raise UsageError("--tcp-rmem-max: sets the emulated hosts' TCP; add --hosts")
    if value < MIN_TCP_RMEM_MAX:
        raise UsageError(f"--tcp-rmem-max: must be >= {MIN_TCP_RMEM_MAX} bytes, got {value}")


def serve_hosts(
    job: Job, state_path: Path, write_state: Any, *, tcp_rmem_max: int | None = None
) -> int:
    """Create the job's hosts and serve their links until stopped. ``tcp_rmem_max``:
    the hosts' largest TCP receive buffer (``None``: :data:`TCP_BUFFER_MAX`)."""
    try:
        check_support()
    except HostsUnavailable as exc:
        raise UsageError(str(exc)) from None
    hosts = Hosts(
        job.name,
        [s.name for s in job.sites],
        tcp_rmem_max=TCP_BUFFER_MAX if tcp_rmem_max is None else tcp_rmem_max,
    )
    try:
        made = hosts.create()
    except RuntimeError as exc:
        raise UsageError(str(exc)) from None
    control_thread = None
    try:
        ports = {s.name: (s.address[1] if s.address else DEFAULT_PORT) for s in job.sites}
        listen = {
            s.name: [(made[s.name].address, ports[s.name] + r) for r in range(s.ranks)]
            for s in job.sites
        }
        router = Router(Topology.for_job(job, listen), made)
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, lambda *_: router.stop())
        control = _ControlThread(router, job)
        control_thread = control
        control.start()
        state = {
            "version": 1,
            "job": job.name,
            "backend": "hosts",
            "pid": os.getpid(),
            "control": "{}:{}".format(*control.address),
            "sites": {
                s.name: {
                    "ranks": s.ranks,
                    "address": made[s.name].address,
                    "netns": made[s.name].netns,
                    "device": made[s.name].device,
                    "listen": ["{}:{}".format(*a) for a in listen[s.name]],
                    "dial": {
                        other.name: ["{}:{}".format(*a) for a in listen[other.name]]
                        for other in job.sites
                        if other.name != s.name
                    },
                }
                for s in job.sites
            },
        }
        write_state(state_path, state)
        for s in job.sites:
            host = made[s.name]
            print(f"host {s.name}: {host.address} (namespace {host.netns}, device {host.device})")
        print(
            f"ready: {len(made)} hosts, {len(router.links)} links; state in {state_path}; "
            f"run a command in a host with: isthmus wan exec JOB.yaml SITE -- COMMAND",
            flush=True,
        )
        router.run()
        stats = router.stats()
    finally:
        if control_thread is not None:
            control_thread.stop()
        hosts.remove()
        with contextlib.suppress(FileNotFoundError):
            state_path.unlink()
    from isthmus.sim.emulator_control import format_stats

    print(format_stats(stats), flush=True)
    return 0


class _ControlThread:
    """Runs the control service and the fault schedule on an asyncio loop of their own."""

    def __init__(self, router: Router, job: Job) -> None:
        self.router = router
        self.job = job
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True, name="control")
        self.address: tuple[str, int] = ("127.0.0.1", 0)

    def start(self) -> None:
        self.thread.start()
        future = asyncio.run_coroutine_threadsafe(self._start(), self.loop)
        self.address = future.result(timeout=30)

    async def _start(self) -> tuple[str, int]:
        progress = Progress()
        self.server = ControlServer(self.router, progress=progress)
        address = await self.server.start()
        started_at = asyncio.get_running_loop().time()
        self.tasks = [
            asyncio.ensure_future(
                run_fault(f, self.router.link(*f.link), started_at=started_at, progress=progress)
            )
            for f in self.router.topology.faults
        ]
        return address

    async def _stop(self) -> None:
        for task in self.tasks:
            task.cancel()
        await self.server.stop()

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(self._stop(), self.loop).result(timeout=10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


def exec_in_host(job: Job, site: str, command: list[str]) -> int:
    """Replace this process with ``command`` run inside ``site``'s host."""
    job.site(site)  # a KeyError names the sites
    if not command:
        raise UsageError("give the command to run after '--', e.g. -- ip addr")
    netns = netns_name(job.name, site)
    if not Path("/run/netns", netns).exists():
        raise UsageError(
            f"no host for site {site!r} of job {job.name!r}; start "
            f"'isthmus wan up {job.source} --hosts' first"
        )
    sys.stdout.flush()
    os.execvp("ip", ["ip", "netns", "exec", netns, *command])
    return 127  # not reached
