"""The packet router of the packet-level backend: every IP packet between hosts crosses it.

It holds the TUN descriptor of every emulated host (:mod:`isthmus.sim.hosts`),
reads each IPv4 packet, finds the link from the source host to the destination
host, and writes the packet to the destination's TUN after that direction of
the link has delayed, rate-limited, lost or corrupted it. The link model is
the one the TCP proxy uses (:mod:`isthmus.job.link` and its processes); only
the carrier differs: here a loss really drops a packet, a full queue really
tail-drops, and the hosts' own TCP stacks react to both.

One thread runs an epoll loop (cheaper here than asyncio or threads); the
control service and the fault schedule run on a second thread and change the
links under a lock.
"""

from __future__ import annotations

import dataclasses
import errno
import heapq
import ipaddress
import os
import select
import threading
import time
from dataclasses import dataclass
from typing import Any

from isthmus.job.link import DirectionParams
from isthmus.sim import gso
from isthmus.sim.direction import DirectionModel, LinkModel
from isthmus.sim.hosts import Host
from isthmus.sim.timerfd import TimerFD
from isthmus.sim.topology import Topology

# A timerfd wakes the loop ~0.1 ms after a packet is due: packets due within
# this slack are written on a wake-up, which centres the error on zero.
TIMER_SLACK_S = 0.0001
# The loop wakes at least this often to notice stop().
STOP_CHECK_S = 0.2
MAX_FRAME = gso.VNET_HDR_LEN + 65536
# The shortest read that holds an IPv4 header.
MIN_FRAME = gso.VNET_HDR_LEN + 20
# Where an IPv4 packet's destination address lies in a TUN read.
DST_ADDRESS = slice(gso.VNET_HDR_LEN + 16, gso.VNET_HDR_LEN + 20)


@dataclass
class PacketCounters:
    """Counters of one direction of one link. Segments are TCP's real segments,
    whether the hosts handed them over one by one or as offload super-packets."""

    bytes: int = 0
    """Bytes on the wire that crossed (every segment's headers included)."""
    segments: int = 0
    frames: int = 0
    """Reads from the source device (a super-packet is one frame, many segments)."""
    segments_delayed: int = 0
    lost_segments: int = 0
    """Dropped by the loss model."""
    queue_drops: int = 0
    """Segments tail-dropped because the bottleneck queue was full."""
    partition_drops: int = 0
    corrupted_segments: int = 0
    """Hit by corruption: the receiver's checksum discards them, TCP resends."""


class PacketDirection(DirectionModel):
    """One direction of a link as the router applies it to packets."""

    def __init__(self, **kwargs: Any) -> None:
        self.counters = PacketCounters()
        self._last_deliver = 0.0
        super().__init__(**kwargs)

    def apply(self, params: DirectionParams) -> None:
        super().apply(params)
        self._lossy = params.loss > 0 or params.corrupt > 0

    def admit(self, data: bytes, now: float) -> list[tuple[float, bytes]]:
        """What of one TUN read reaches the other end, and when: (time, bytes to write).

        Most frames cross whole; only a frame that loses segments (to the loss
        model, corruption or a full queue) is parsed and cut.
        """
        c = self.counters
        c.frames += 1
        segments, wire = gso.measure(data)
        if self.blackholed:
            c.partition_drops += segments
            return []
        keep = segments
        if self.slowest_rate is not None:
            # Tail drop: the segments that do not fit in the queue are lost.
            room = (self.queue_s - self.backlog_s(now)) * self.slowest_rate
            keep = min(segments, max(0, int(room // (wire / segments)) + (room > 0)))
        if keep < segments or self._lossy:
            return self._admit_cut(data, segments, keep, now)
        return [(self._schedule(wire, segments, now), data)]

    def _schedule(self, wire: int, segments: int, now: float) -> float:
        """Reserve the link for ``wire`` bytes; when they reach the other end."""
        c = self.counters
        depart = self.reserve(wire, now)
        c.bytes += wire
        c.segments += segments
        if self.delayed:
            c.segments_delayed += segments
        deliver = max(depart + self.jitter.sample_s(), self._last_deliver)
        self._last_deliver = deliver
        return deliver

    def _admit_cut(
        self, data: bytes, segments: int, keep: int, now: float
    ) -> list[tuple[float, bytes]]:
        """The slow path: the frame loses segments to a full queue, loss or corruption."""
        c = self.counters
        frame = gso.parse(data)
        if frame is None:
            return []
        if keep < segments:
            c.queue_drops += segments - keep
            if keep == 0:
                return []
            if frame.is_tcp_gso:
                frame = gso.slice_segments(frame, 0, keep)
                data = frame.encode()
        deliver = self._schedule(frame.wire_bytes, keep, now)
        dropped = set(self.loss.lost_positions(keep))
        c.lost_segments += len(dropped)
        if self.params.corrupt:
            corrupted = self._corrupted_positions(keep, frame.wire_bytes / keep) - dropped
            c.corrupted_segments += len(corrupted)
            dropped |= corrupted
        if not dropped:
            return [(deliver, data)]
        if not frame.is_tcp_gso:
            return []
        # Cut the super-packet around the lost segments: runs of kept segments
        # leave as smaller super-packets (or single segments).
        out = []
        run_start = None
        for index in range(keep + 1):
            if index < keep and index not in dropped:
                if run_start is None:
                    run_start = index
            elif run_start is not None:
                piece = gso.slice_segments(frame, run_start, index - run_start)
                out.append((deliver, piece.encode()))
                run_start = None
        return out

    def _corrupted_positions(self, segments: int, segment_bytes: float) -> set[int]:
        p = 1.0 - (1.0 - self.params.corrupt) ** segment_bytes
        return {i for i in range(segments) if self.rng.random() < p}

    def stats(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self.counters), "blackholed": self.blackholed}


class PacketLink(LinkModel[PacketDirection]):
    """A link of the router. Its controls run on the control thread, so they change
    the directions under the router's lock. At packet level both partition modes
    drop every packet; the hosts' TCP then times out as on a real cut."""

    direction_class = PacketDirection

    def __init__(self, *args: Any, lock: threading.Lock, **kwargs: Any) -> None:
        self._lock = lock
        super().__init__(*args, **kwargs)

    def _apply(self, changes: list[tuple[PacketDirection, DirectionParams]]) -> None:
        with self._lock:
            super()._apply(changes)

    def _cut(self, mode: str) -> None:
        with self._lock:
            super()._cut(mode)

    def _heal(self) -> None:
        with self._lock:
            super()._heal()


class Router:
    """Routes packets among ``hosts`` through the links of ``topology``."""

    def __init__(self, topology: Topology, hosts: dict[str, Host]) -> None:
        self.topology = topology
        self.hosts = hosts
        self.lock = threading.Lock()
        limits = topology.shared_limits()
        self.links: dict[frozenset[str], PacketLink] = {
            frozenset((a, b)): PacketLink(
                a,
                b,
                topology.link_params(a, b),
                seed=topology.seed,
                lock=self.lock,
                limits=limits,
            )
            for a, b in topology.pairs()
        }
        self._by_address = {ipaddress.IPv4Address(h.address).packed: h for h in hosts.values()}
        self._by_fd = {h.fd: h for h in hosts.values()}
        # (src fd, dst address) -> (direction, dst fd), or None for an address
        # that is no other host; filled on first use.
        self._routes: dict[tuple[int, bytes], tuple[PacketDirection, int] | None] = {}
        self._line: list[tuple[float, int, int, bytes]] = []
        self._seq = 0
        # A plain flag, not a threading.Event: stop() runs in signal handlers,
        # and Event.set() takes a lock that a second signal would deadlock on.
        self._stopping = False
        self.other_packets = 0
        """Packets that are not IPv4 between two hosts (IPv6 neighbour discovery...)."""
        self.write_drops = 0
        self.started_at = time.monotonic()

    def link(self, a: str, b: str) -> PacketLink:
        try:
            return self.links[frozenset((a, b))]
        except KeyError:
            names = ", ".join(s.name for s in self.topology.sites)
            raise KeyError(f"no link between {a!r} and {b!r}; sites: {names}") from None

    def stats(self) -> dict[str, Any]:
        with self.lock:
            return {
                "backend": "hosts",
                "uptime_s": time.monotonic() - self.started_at,
                "links": [link.stats() for link in self.links.values()],
                "other_packets": self.other_packets,
                "write_drops": self.write_drops,
            }

    def stop(self) -> None:
        """Ask :meth:`run` to return (safe from a signal handler or another thread)."""
        self._stopping = True

    def _route(self, fd: int, dst: bytes) -> tuple[PacketDirection, int] | None:
        src_host = self._by_fd[fd]
        dst_host = self._by_address.get(dst)
        if dst_host is None or dst_host is src_host:
            route = None
        else:
            link = self.link(src_host.site, dst_host.site)
            direction = link.a_to_b if link.a == src_host.site else link.b_to_a
            route = (direction, dst_host.fd)
        self._routes[fd, dst] = route
        return route

    def run(self) -> None:
        """Route until :meth:`stop`; the caller owns the devices and closes them after.

        This loop runs for every packet, so it is written for the interpreter:
        names it calls are bound to locals, and a frame that crosses whole is
        never parsed beyond its size (see :meth:`PacketDirection.admit`).
        """
        poller = select.epoll()
        timer = TimerFD()
        timer_fd = timer.fd
        # Edge-triggered: re-arming resets the timer, so its expiry need not be
        # read (one system call less per wake-up).
        poller.register(timer_fd, select.EPOLLIN | select.EPOLLET)
        for fd in self._by_fd:
            poller.register(fd, select.EPOLLIN)
        line = self._line
        lock = self.lock
        poll = poller.poll
        monotonic = time.monotonic
        try:
            while not self._stopping:
                if line:
                    timer.arm(line[0][0] - TIMER_SLACK_S)
                events = poll(STOP_CHECK_S)
                with lock:
                    now = monotonic()
                    for fd, _ in events:
                        if fd == timer_fd:
                            timer.fired()
                            continue
                        self._read(fd, now)
                    if line and line[0][0] <= now + TIMER_SLACK_S:
                        self._deliver(monotonic() + TIMER_SLACK_S)
        finally:
            poller.close()
            timer.close()

    def _read(self, fd: int, now: float) -> None:
        """Read and admit one frame from ``fd``.

        One frame per call: epoll is level-triggered, so a device with more
        frames is reported again at once, and no read ends in an EAGAIN
        exception (costly in Python; most events carry one frame).
        """
        try:
            data = os.read(fd, MAX_FRAME)
        except BlockingIOError:
            return
        if len(data) < MIN_FRAME or data[gso.VNET_HDR_LEN] >> 4 != 4:
            self.other_packets += 1
            return
        dst = data[DST_ADDRESS]
        routes = self._routes
        route = routes[fd, dst] if (fd, dst) in routes else self._route(fd, dst)
        if route is None:
            self.other_packets += 1
            return
        direction, dst_fd = route
        line = self._line
        for deliver, out in direction.admit(data, now):
            self._seq += 1
            heapq.heappush(line, (deliver, self._seq, dst_fd, out))

    def _deliver(self, horizon: float) -> None:
        line = self._line
        pop = heapq.heappop
        write = os.write
        while line and line[0][0] <= horizon:
            _, _, fd, packet = pop(line)
            try:
                write(fd, packet)
            except OSError as exc:
                # A full device queue or a host that went down: the packet is lost,
                # as on a real link; TCP recovers.
                if exc.errno not in (errno.EAGAIN, errno.EIO, errno.EBADF):
                    raise
                self.write_drops += 1
