"""The client end of the peer service: a session with one counterpart rank of another site.

``Hello`` opens the session (job, protocol version and layout checked by the
peer); ``Exchange`` streams chunks and gets an acknowledgement for each. A
session may hold several TCP connections (``connections_per_peer``): one
connection carries at most its TCP window per round trip, less than a long fat
link holds. The server end is :mod:`isthmus.inter.peer`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterable

import grpc

from isthmus.inter.peer import (
    META_JOB,
    META_RANK,
    META_SITE,
    PROTOCOL_VERSION,
    Identity,
    PeerError,
)
from isthmus.inter.transport import TransportSettings
from isthmus.proto import wire_pb2, wire_pb2_grpc

_FINAL = frozenset(
    {
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.UNIMPLEMENTED,
    }
)
"""Codes that another try would get again. Every other code can come from a broken
connection: a reset (UNAVAILABLE), a frame that no longer parses (INTERNAL), a
garbled length prefix (RESOURCE_EXHAUSTED: "message larger than max")."""


class PeerClient:
    """A session with one counterpart rank of another site, over
    ``settings.connections_per_peer`` TCP connections (one gRPC channel each):
    handshakes and state pulls use the first, the all-reduce's streams any of them
    (``connection=``)."""

    def __init__(
        self,
        identity: Identity,
        address: str,
        *,
        settings: TransportSettings | None = None,
        deadline_s: float = 30.0,
        peer_site: str | None = None,
    ) -> None:
        """``peer_site``: the site this address should belong to; under mutual TLS
        the server's certificate must name it."""
        self.identity = identity
        self.address = address
        self.deadline_s = deadline_s
        self.settings = settings or TransportSettings()
        if self.settings.tls is not None and peer_site is None:
            raise ValueError("a TLS session needs the peer's site name (peer_site=)")
        self.peer_site = peer_site
        self._generation = 0
        self._channels = [self._open() for _ in range(self.settings.connections_per_peer)]
        self.peer: tuple[str, int] | None = None

    @property
    def connections(self) -> int:
        return len(self._channels)

    @property
    def channel(self) -> grpc.aio.Channel:
        return self._channels[0][0]

    @property
    def stub(self) -> wire_pb2_grpc.PeerServiceStub:
        return self._channels[0][1]

    def _open(self) -> tuple[grpc.aio.Channel, wire_pb2_grpc.PeerServiceStub]:
        options = self.settings.channel_options()
        tls = self.settings.tls
        if tls is None:
            channel = grpc.aio.insecure_channel(self.address, options=options)
        else:
            assert self.peer_site is not None
            options += tls.channel_options(self.peer_site)
            self._generation = tls.generation
            channel = grpc.aio.secure_channel(
                self.address, tls.channel_credentials(), options=options
            )
        return channel, wire_pb2_grpc.PeerServiceStub(channel)

    async def reconnect(self, connection: int | None = None) -> None:
        """Drop a connection (all of them: None) and dial a new one: for a connection
        that stalls without failing (a garbled frame can leave both ends waiting).
        Calls in flight on the old one fail and are retried by their senders."""
        which = range(self.connections) if connection is None else [connection]
        for i in which:
            old, _ = self._channels[i]
            self._channels[i] = self._open()
            await old.close()

    async def _follow_certificates(self) -> None:
        """Files replaced since the channels were made: dial again with the new ones
        (a channel keeps the credentials it was made with, even to reconnect)."""
        tls = self.settings.tls
        if tls is not None and tls.generation != self._generation:
            await self.reconnect()

    async def hello(self) -> wire_pb2.HandshakeReply:
        await self._follow_certificates()
        me = self.identity
        request = wire_pb2.Handshake(
            job=me.job,
            site=me.site,
            rank=me.rank,
            protocol_version=PROTOCOL_VERSION,
            layout_fingerprint=me.layout_fingerprint,
            layout=me.layout,
        )
        try:
            reply = await self.stub.Hello(request, timeout=self.deadline_s, wait_for_ready=True)
        except grpc.aio.AioRpcError as exc:
            # No answer (down, not started yet) may change; a refusal will not.
            unanswered = exc.code() in (
                grpc.StatusCode.DEADLINE_EXCEEDED,
                grpc.StatusCode.UNAVAILABLE,
            )
            raise PeerError(self._describe(exc), transient=unanswered) from None
        if not reply.accepted:
            raise PeerError(f"peer {self.address} refused the session: {reply.error.message}")
        self.peer = (reply.site, reply.rank)
        return reply

    async def exchange(
        self,
        chunks: Iterable[wire_pb2.Chunk] | AsyncIterator[wire_pb2.Chunk],
        *,
        on_ack: Callable[[wire_pb2.Ack], None] | None = None,
        timeout_s: float | None = None,
        wait_for_ready: bool = False,
        connection: int = 0,
    ) -> list[wire_pb2.Ack]:
        """Send ``chunks`` on one stream, as they come; return the peer's acknowledgement
        of each, and hand each to ``on_ack`` as it arrives. An async iterator lets the
        caller encode chunk k+1 while k is sent. ``timeout_s``: for this stream
        (default: the session's deadline); ``wait_for_ready``: wait for a broken
        connection to come back instead of failing at once; ``connection``: which of
        the session's connections carries the stream."""
        await self._follow_certificates()
        me = self.identity
        metadata = ((META_JOB, me.job), (META_SITE, me.site), (META_RANK, str(me.rank)))
        requests = chunks if hasattr(chunks, "__aiter__") else iter(chunks)
        timeout = self.deadline_s if timeout_s is None else timeout_s
        acks: list[wire_pb2.Ack] = []
        try:
            call = self._channels[connection][1].Exchange(
                requests, timeout=timeout, metadata=metadata, wait_for_ready=wait_for_ready
            )
            async for ack in call:
                if ack is None:  # how gRPC hands on an answer that does not parse
                    call.cancel()
                    raise PeerError(
                        f"peer {self.address} sent an answer that does not parse "
                        "(garbled on the way)",
                        transient=True,
                    )
                acks.append(ack)
                if on_ack is not None:
                    on_ack(ack)
        except grpc.aio.AioRpcError as exc:
            raise PeerError(
                self._describe(exc, timeout), transient=exc.code() not in _FINAL
            ) from None
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # we are being cancelled
            # gRPC reports a call on a channel that was closed under it (another
            # sender to this peer redialled: see reconnect) as a cancellation.
            raise PeerError(
                f"the connection to {self.address} was replaced", transient=True
            ) from None
        return acks

    def _describe(self, exc: grpc.aio.AioRpcError, timeout_s: float | None = None) -> str:
        code = exc.code()
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return (
                f"peer {self.address} did not answer within "
                f"{self.deadline_s if timeout_s is None else timeout_s:g} s "
                "(down, partitioned, or the address is wrong)"
            )
        if code == grpc.StatusCode.UNAVAILABLE:
            return f"peer {self.address} is unreachable: {exc.details()}"
        return f"peer {self.address} refused: {code.name}: {exc.details()}"

    async def close(self) -> None:
        for channel, _ in self._channels:
            await channel.close()
