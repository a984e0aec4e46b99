"""The TCP-proxy backend of the WAN emulator: loopback proxies that behave like long-haul links.

Each connection that crosses an emulated link is accepted by a listener of the
emulator and forwarded to its real destination. The bytes of each direction go
through a :class:`Pipe`, which applies that direction's link model:

    read from sender -> pending -> (rate limiters, loss) -> delay line -> write to receiver

* Rate: a shared :class:`~isthmus.sim.token_bucket.TokenBucket` per link direction
  (and per site uplink, when capped) gives every batch its departure time, so
  all connections of a link share its bandwidth.
* Delay and jitter: each batch is delivered at departure + a sampled one-way
  delay, never before the batch ahead of it (the stream is never reordered).
* Loss: TCP repairs losses, so a lost segment stalls the stream for a
  retransmission timeout; the sender's data waits meanwhile.
* Back-pressure: a connection may have at most ``window_bytes`` in flight
  (credit returns one reverse delay after delivery, like an ACK), and the
  link's queue holds at most ``queue_ms`` of its rate. Beyond that the proxy
  stops reading, so TCP flow control slows the sender and memory stays bounded.

Each direction's pipe lives in :mod:`isthmus.sim.pipe`. Everything runs on one
asyncio loop; reads and writes use asyncio protocols
(no per-chunk coroutine), the cheapest path asyncio offers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import struct
from typing import Any

from isthmus.job.link import DirectionParams
from isthmus.sim import precise_timers
from isthmus.sim.direction import LinkModel
from isthmus.sim.pipe import DirectionRuntime, Pipe

log = logging.getLogger(__name__)


class _Side(asyncio.Protocol):
    """The asyncio protocol of one end of a proxied connection (client or upstream)."""

    def __init__(self, connection: ProxiedConnection, name: str) -> None:
        self.connection = connection
        self.name = name
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.connection.side_made(self)

    def data_received(self, data: bytes) -> None:
        self.connection.outgoing(self).feed(data)

    def eof_received(self) -> bool:
        self.connection.outgoing(self).feed_eof()
        return True  # keep our write side open until the other direction is done

    def pause_writing(self) -> None:
        self.connection.incoming(self).pause_writing()

    def resume_writing(self) -> None:
        self.connection.incoming(self).resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self.connection.side_lost(self, exc)


class ProxiedConnection:
    """A client connection on one site and its upstream connection on the other."""

    def __init__(self, link: LinkRuntime, forward: DirectionRuntime, upstream: tuple[str, int]):
        self.loop = asyncio.get_running_loop()
        self.link = link
        self.upstream_address = upstream
        reverse = link.other(forward)
        self.client = _Side(self, "client")
        self.server = _Side(self, "upstream")
        self.to_server = Pipe(self, forward, reverse)
        self.to_client = Pipe(self, reverse, forward)
        self._closed = False
        self._connect_task: asyncio.Task[None] | None = None
        forward.counters.connections += 1
        link.connections.add(self)

    def outgoing(self, side: _Side) -> Pipe:
        return self.to_server if side is self.client else self.to_client

    def incoming(self, side: _Side) -> Pipe:
        return self.to_client if side is self.client else self.to_server

    def side_made(self, side: _Side) -> None:
        assert side.transport is not None
        if self._closed:  # the client went away while the upstream was connecting
            side.transport.close()
            return
        self.outgoing(side).src = side.transport
        self.incoming(side).attach_destination(side.transport)
        if side is self.client:
            self.connect_upstream()

    def connect_upstream(self) -> None:
        """Open the real connection, one one-way delay later (the SYN crosses the link)."""
        if self._closed or self._connect_task is not None:
            return
        if self.to_server.direction.blackholed:
            return  # a SYN into a black hole: LinkRuntime.heal() calls us again
        self._connect_task = asyncio.ensure_future(self._connect())

    async def _connect(self) -> None:
        await asyncio.sleep(self.to_server.direction.params.delay_ms / 1e3)
        host, port = self.upstream_address
        try:
            await self.loop.create_connection(lambda: self.server, host, port)
        except OSError as exc:
            self.to_server.direction.counters.upstream_failures += 1
            log.warning(
                "link %s: upstream %s:%s unreachable (%s); closed the client connection",
                self.link.name,
                host,
                port,
                exc.strerror or exc,
            )
            self.reset()

    def pipe_finished(self, pipe: Pipe) -> None:
        """A direction delivered everything up to its sender's EOF: pass the EOF on."""
        dst = pipe.dst
        if dst is not None and not dst.is_closing():
            if dst.can_write_eof():
                with contextlib.suppress(OSError, RuntimeError):
                    dst.write_eof()
            else:
                dst.close()
        if self.to_server.done and self.to_client.done:
            self.close()

    def side_lost(self, side: _Side, exc: Exception | None) -> None:
        if self._closed:
            return
        # Nothing can reach that side anymore; what it already sent still
        # crosses, and then the other side is closed cleanly.
        self.incoming(side).close()
        outgoing = self.outgoing(side)
        if exc is not None:
            outgoing.direction.counters.disconnects += 1
        outgoing.feed_eof()
        if self.to_server.done and self.to_client.done:
            self.close()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for pipe in (self.to_server, self.to_client):
            pipe.close()
        for side in (self.client, self.server):
            if side.transport is not None and not side.transport.is_closing():
                side.transport.close()
        if self._connect_task is not None:
            self._connect_task.cancel()
        self.link.connections.discard(self)

    def reset(self) -> None:
        """Tear down both ends with a TCP RST, as a reset partition does."""
        for side in (self.client, self.server):
            if side.transport is not None:
                _abort_with_rst(side.transport)
        self.close()


def _abort_with_rst(transport: asyncio.Transport) -> None:
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            # Linger 0: close() sends RST instead of FIN.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


class LinkRuntime(LinkModel[DirectionRuntime]):
    """A running link of the proxy: both directions, their connections, and the controls."""

    direction_class = DirectionRuntime

    def __init__(self, *args: Any, timers: precise_timers.PreciseTimers, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.timers = timers
        """Where the link's deliveries are scheduled (sub-millisecond precision)."""
        self.connections: set[ProxiedConnection] = set()
        self.reset_mode = False

    @property
    def state(self) -> str:
        return "reset" if self.reset_mode else super().state

    def _apply(self, changes: list[tuple[DirectionRuntime, DirectionParams]]) -> None:
        for direction, params in changes:
            direction.update(params)

    def _cut(self, mode: str) -> None:
        """blackhole: bytes stop and connections hang; reset: connections torn down."""
        super()._cut(mode)
        for d in (self.a_to_b, self.b_to_a):
            for pipe in list(d.pipes):
                pipe.blackhole()
        if mode == "reset":
            self.reset_mode = True
            for conn in list(self.connections):
                conn.to_server.direction.counters.resets += 1
                conn.reset()

    def _heal(self) -> None:
        """Held bytes flow again and waiting connections are opened."""
        self.reset_mode = False
        super()._heal()
        for conn in list(self.connections):
            conn.connect_upstream()
        for d in (self.a_to_b, self.b_to_a):
            for pipe in list(d.pipes):
                pipe.pump()


class Listener:
    """Accepts connections from site ``src`` meant for rank ``rank`` of site ``dst``."""

    def __init__(self, link: LinkRuntime, src: str, upstream: tuple[str, int]) -> None:
        self.link = link
        self.forward = link.direction(src)
        self.upstream = upstream
        self.server: asyncio.Server | None = None

    async def start(self, host: str, port: int) -> tuple[str, int]:
        loop = asyncio.get_running_loop()
        self.server = await loop.create_server(self._accept, host, port, reuse_address=True)
        sockname = self.server.sockets[0].getsockname()
        return sockname[0], sockname[1]

    def _accept(self) -> asyncio.Protocol:
        if self.link.reset_mode:
            self.forward.counters.resets += 1
            return _Refuse()
        return ProxiedConnection(self.link, self.forward, self.upstream).client

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()


class _Refuse(asyncio.Protocol):
    """During a reset partition, a new connection is answered with a RST."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        _abort_with_rst(transport)
