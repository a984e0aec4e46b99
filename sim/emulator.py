"""The WAN emulator: every link of a topology, its listeners, faults and counters.

``Emulator`` runs inside an asyncio loop (``isthmus wan up`` runs one in the
foreground; ``BackgroundEmulator`` runs one on a thread for synchronous code
and tests). For each ordered pair of sites (src, dst) and each rank r of dst it
listens on a loopback port; a process of site src that wants rank r of dst
dials that port instead of dst's own address (:meth:`Emulator.dial_map`), and
its bytes cross the emulated link src<->dst.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from isthmus.sim.fault_runner import Progress, run_fault
from isthmus.sim.precise_timers import PreciseTimers
from isthmus.sim.proxy import LinkRuntime, Listener
from isthmus.sim.topology import Topology

log = logging.getLogger(__name__)
T = TypeVar("T")


class Emulator:
    """All links of ``topology``, carried by TCP proxies on ``host``."""

    def __init__(
        self,
        topology: Topology,
        *,
        host: str = "127.0.0.1",
        listen: dict[tuple[str, str, int], tuple[str, int]] | None = None,
    ) -> None:
        """``listen`` fixes the address of chosen listeners, keyed (src, dst, rank);
        the others take a free port on ``host``."""
        self.topology = topology
        self.host = host
        self._fixed_listen = listen or {}
        limits = topology.shared_limits()
        # Construct the emulator on the loop that will run it: its timers live there.
        self._timers = PreciseTimers(asyncio.get_running_loop())
        self.links: dict[frozenset[str], LinkRuntime] = {}
        for a, b in topology.pairs():
            self.links[frozenset((a, b))] = LinkRuntime(
                a,
                b,
                topology.link_params(a, b),
                seed=topology.seed,
                limits=limits,
                timers=self._timers,
            )
        self._listeners: dict[tuple[str, str, int], tuple[Listener, tuple[str, int]]] = {}
        self._fault_tasks: list[asyncio.Task[None]] = []
        self._started_at: float | None = None
        self.progress = Progress()
        """The sites' rounds, as reported; what round-triggered faults wait on."""

    # -- lifecycle ----------------------------------------------------------------
    async def start(self) -> None:
        """Open every listener and start the fault schedule. Raises OSError naming the
        address when a fixed listen address cannot be bound."""
        loop = asyncio.get_running_loop()
        try:
            for src in self.topology.sites:
                for dst in self.topology.sites:
                    if src.name == dst.name:
                        continue
                    link = self.link(src.name, dst.name)
                    for rank, upstream in enumerate(dst.listen):
                        key = (src.name, dst.name, rank)
                        host, port = self._fixed_listen.get(key, (self.host, 0))
                        listener = Listener(link, src.name, upstream)
                        try:
                            address = await listener.start(host, port)
                        except OSError as exc:
                            raise OSError(
                                exc.errno,
                                f"cannot listen on {host}:{port} ({exc.strerror}); "
                                "pick another port or stop the process using it",
                            ) from exc
                        self._listeners[key] = (listener, address)
        except BaseException:
            await self.stop()
            raise
        self._started_at = loop.time()
        self._fault_tasks = [
            asyncio.ensure_future(
                run_fault(
                    f, self.link(*f.link), started_at=self._started_at, progress=self.progress
                )
            )
            for f in self.topology.faults
        ]

    async def stop(self) -> None:
        for task in self._fault_tasks:
            task.cancel()
        for listener, _ in self._listeners.values():
            await listener.stop()
        for link in self.links.values():
            for conn in list(link.connections):
                conn.close()
        self._timers.close()

    # -- addressing -------------------------------------------------------------
    def link(self, a: str, b: str) -> LinkRuntime:
        try:
            return self.links[frozenset((a, b))]
        except KeyError:
            names = ", ".join(s.name for s in self.topology.sites)
            raise KeyError(f"no link between {a!r} and {b!r}; sites: {names}") from None

    def dial_address(self, src: str, dst: str, rank: int) -> tuple[str, int]:
        """Where a process of site ``src`` connects to reach rank ``rank`` of site ``dst``."""
        return self._listeners[(src, dst, rank)][1]

    def dial_map(self) -> dict[str, dict[str, list[str]]]:
        """``{src: {dst: ["host:port" of each rank of dst]}}`` for every pair of sites."""
        out: dict[str, dict[str, list[str]]] = {}
        for src in self.topology.sites:
            out[src.name] = {
                dst.name: [
                    "{}:{}".format(*self.dial_address(src.name, dst.name, r))
                    for r in range(dst.ranks)
                ]
                for dst in self.topology.sites
                if dst.name != src.name
            }
        return out

    # -- counters -------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        return {
            "backend": "proxy",
            "uptime_s": (
                asyncio.get_running_loop().time() - self._started_at
                if self._started_at is not None
                else 0.0
            ),
            "links": [link.stats() for link in self.links.values()],
        }


class BackgroundEmulator:
    """Runs an :class:`Emulator` on its own thread and event loop, for synchronous code.

    Use as a context manager; every method is safe to call from any thread::

        with BackgroundEmulator(topology) as wan:
            host, port = wan.dial_address("us-east", "eu-west", 0)
            wan.call(lambda e: e.link("us-east", "eu-west").cut())
    """

    def __init__(self, topology: Topology, **kwargs: Any) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="wan")
        self._kwargs = kwargs
        self._topology = topology
        self.emulator: Emulator | None = None

    def __enter__(self) -> BackgroundEmulator:
        self._thread.start()
        try:
            self.emulator = self.run(self._create())
        except BaseException:
            self._shutdown()
            raise
        return self

    async def _create(self) -> Emulator:
        emulator = Emulator(self._topology, **self._kwargs)
        await emulator.start()
        return emulator

    def __exit__(self, *exc: object) -> None:
        if self.emulator is not None:
            self.run(self.emulator.stop())
        self._shutdown()

    def _shutdown(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 30.0) -> T:
        """Run a coroutine on the emulator's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def call(self, fn: Callable[[Emulator], T], timeout: float = 30.0) -> T:
        """Call ``fn(emulator)`` on the emulator's loop (where its objects live)."""
        assert self.emulator is not None
        emulator = self.emulator

        async def invoke() -> T:
            return fn(emulator)

        return self.run(invoke(), timeout)

    def dial_address(self, src: str, dst: str, rank: int = 0) -> tuple[str, int]:
        return self.call(lambda e: e.dial_address(src, dst, rank))

    def stats(self) -> dict[str, Any]:
        return self.call(lambda e: e.stats())
