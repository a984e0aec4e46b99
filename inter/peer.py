"""The peer service: one gRPC endpoint per local rank, through which sites exchange tensors.

A rank dials each counterpart in the other sites, opens a session with
``Hello`` (job, protocol version and layout must match, or it is refused with
a message that says which), then streams chunks with ``Exchange``; every chunk
is verified (checksum, codec, sizes) and acknowledged, or refused with the
reason and never applied. Verified chunks are handed to the collective engine
through ``on_chunk``, which decodes each as it arrives.

Every call carries a deadline. Interceptors give an authentication hook and
per-method metrics; the standard gRPC health service answers for the site.
This module is the server end; the client end is :mod:`isthmus.inter.peer_client`.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import Counter, deque
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from isthmus.inter.chunks import ChunkError, ReceivedChunk, verify
from isthmus.inter.tls import certified_sites, peer_certificate
from isthmus.inter.transport import TransportSettings
from isthmus.proto import wire_pb2, wire_pb2_grpc

if TYPE_CHECKING:
    from isthmus.inter.revocation import Revocations

log = logging.getLogger(__name__)

PROTOCOL_VERSION = 3
LOG_EVERY_S = 10.0
"""Refusals of one kind are logged at most this often, with a count of the rest."""
REFUSALS_KEPT = 100
"""How many refusal reasons a service keeps for inspection (the counts are kept in full)."""
SERVICE_NAME = "isthmus.wire.PeerService"
# Who is calling Exchange: set by PeerClient, checked by the servicer.
META_JOB, META_SITE, META_RANK = "isthmus-job", "isthmus-site", "isthmus-rank"


@dataclass(frozen=True, kw_only=True)
class Identity:
    """Who a rank is, as the other sites must see it."""

    job: str
    site: str
    rank: int
    layout_fingerprint: str = ""
    """SHA-256 of the layout every site must share (tensor/pipeline degrees, shapes)."""
    layout: str = ""
    """The same layout in words, for refusals that name both sides."""


ChunkSink = Callable[[ReceivedChunk], Awaitable[None] | bool | None]
"""Where verified chunks go (the collective engine); raising ChunkError refuses one,
returning False says it was dropped unapplied (its round is over there)."""


class PeerError(RuntimeError):
    """A peer refused us or could not be reached; the message names the peer and why.
    ``transient``: the connection broke (reset, a garbled frame) rather than the peer
    saying no or the deadline passing; the same call may well succeed again."""

    def __init__(self, message: str, *, transient: bool = False) -> None:
        super().__init__(message)
        self.transient = transient


class PeerServicer(wire_pb2_grpc.PeerServiceServicer):
    """Checks who calls and what they send; hands verified chunks to ``on_chunk``."""

    def __init__(
        self,
        identity: Identity,
        sites: Collection[str],
        on_chunk: ChunkSink,
        *,
        check_certificates: bool = False,
        max_streams_per_site: int = 256,
        max_message_bytes: int = TransportSettings().max_message_bytes,
        revocations: Revocations | None = None,
    ) -> None:
        self.identity = identity
        self.sites = set(sites)
        self.on_chunk = on_chunk
        self.check_certificates = check_certificates
        """Under mutual TLS: a caller's certificate must name the site it claims."""
        self.revocations = revocations
        """The job's revocation list: a revoked certificate is refused at every call."""
        self.refused: deque[str] = deque(maxlen=REFUSALS_KEPT)
        """Reasons of the latest refused handshakes and chunks, newest last."""
        self.refusals: Counter[str] = Counter()
        """How many refusals of each kind (the wire ErrorCode's name), ever."""
        self._last_logged: dict[str, tuple[float, int]] = {}
        self.state_provider: Any = None
        """What answers FetchState (:mod:`isthmus.inter.state_transfer`): set by the
        strategy that holds the global state; None refuses every request."""
        self.part_bytes = 4 * 1024 * 1024
        self.max_streams_per_site = max_streams_per_site
        self.max_message_bytes = max_message_bytes
        """The largest chunk message a peer may send; a bigger one is cut off, named."""
        self.streams: Counter[str] = Counter()
        """Streams (Exchange, FetchState) open now, per calling site."""

    def check_handshake(self, request: wire_pb2.Handshake) -> wire_pb2.Error | None:
        me = self.identity
        if request.protocol_version != PROTOCOL_VERSION:
            return wire_pb2.Error(
                code=wire_pb2.PROTOCOL_MISMATCH,
                message=f"peer speaks protocol {request.protocol_version}, this site speaks "
                f"{PROTOCOL_VERSION}; run the same Isthmus version on every site",
            )
        if request.job != me.job:
            return wire_pb2.Error(
                code=wire_pb2.WRONG_JOB,
                message=f"peer belongs to job {request.job!r}, this is job {me.job!r}",
            )
        if request.site not in self.sites or request.site == me.site:
            return wire_pb2.Error(
                code=wire_pb2.WRONG_JOB,
                message=f"site {request.site!r} is not another site of job {me.job!r} "
                f"(sites: {', '.join(sorted(self.sites))})",
            )
        if request.layout_fingerprint != me.layout_fingerprint:
            return wire_pb2.Error(
                code=wire_pb2.LAYOUT_MISMATCH,
                message=f"site {request.site!r} has layout "
                f"{request.layout or request.layout_fingerprint[:12]!r}, this site "
                f"{me.layout or me.layout_fingerprint[:12]!r}: tensor/pipeline degrees or "
                "parameter shapes differ",
            )
        return None

    async def Hello(
        self, request: wire_pb2.Handshake, context: grpc.aio.ServicerContext
    ) -> wire_pb2.HandshakeReply:
        # Who is calling first: a caller whose certificate does not back its claim
        # learns nothing of this job (its layout, its protocol).
        error = self._check_certificate(request.site, context) or self.check_handshake(request)
        me = self.identity
        reply = wire_pb2.HandshakeReply(
            accepted=error is None, site=me.site, rank=me.rank, protocol_version=PROTOCOL_VERSION
        )
        if error is not None:
            reply.error.CopyFrom(error)
            self._refuse(f"handshake from {context.peer()}: {error.message}", error.code)
        return reply

    async def Exchange(
        self, request_iterator: AsyncIterator[wire_pb2.Chunk], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[wire_pb2.Ack]:
        metadata = dict(context.invocation_metadata() or ())
        site = metadata.get(META_SITE, "")
        if metadata.get(META_JOB) != self.identity.job or site not in self.sites:
            message = (
                f"Exchange from {context.peer()} names job {metadata.get(META_JOB)!r} and site "
                f"{site!r}; this is job {self.identity.job!r}"
            )
            self._refuse(message)
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, message)
        impostor = self._check_certificate(site, context)
        if impostor is not None:
            self._refuse(impostor.message, impostor.code)
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, impostor.message)
        try:
            rank = int(metadata.get(META_RANK, "0") or 0)
        except ValueError:
            rank = -1  # only named in messages; the chunks still have to pass
        await self._open_stream(site, context)
        try:
            async for chunk in request_iterator:
                if (size := chunk.ByteSize()) > self.max_message_bytes:
                    await self._cut_off_oversized(site, size, context)
                yield await self.accept(chunk, site, rank, context.peer())
        finally:
            self.streams[site] -= 1

    async def FetchState(
        self, request: wire_pb2.StateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[wire_pb2.StatePart]:
        hello = wire_pb2.Handshake(
            job=request.job,
            site=request.site,
            rank=request.rank,
            protocol_version=request.protocol_version,
            layout_fingerprint=request.layout_fingerprint,
        )
        error = self._check_certificate(request.site, context) or self.check_handshake(hello)
        if error is not None:
            self._refuse(f"state request from {context.peer()}: {error.message}", error.code)
            yield wire_pb2.StatePart(error=error)
            return
        await self._open_stream(request.site, context)
        try:
            async for part in self._serve_state(request, context):
                yield part
        finally:
            self.streams[request.site] -= 1

    async def _serve_state(
        self, request: wire_pb2.StateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[wire_pb2.StatePart]:
        from isthmus.inter.state_transfer import serve_state

        log.info(
            "serving the state after %d rounds to site %r (%s) from byte %d",
            request.rounds,
            request.site,
            context.peer(),
            request.offset,
        )
        async for part in serve_state(
            self.state_provider,
            request,
            part_bytes=self.part_bytes,
            time_left=context.time_remaining,
        ):
            yield part

    async def _open_stream(self, site: str, context: grpc.aio.ServicerContext) -> None:
        """Count a stream from ``site``, or cut it off when the site already holds
        ``max_streams_per_site`` open here (a flood, or a peer gone wrong)."""
        if self.streams[site] >= self.max_streams_per_site:
            message = (
                f"site {site!r} ({context.peer()}) already holds {self.streams[site]} streams "
                f"open here, the most a site may (max_streams_per_site): stream cut off"
            )
            self._refuse(message, wire_pb2.TOO_MANY_STREAMS)
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, message)
        self.streams[site] += 1

    async def _cut_off_oversized(
        self, site: str, size: int, context: grpc.aio.ServicerContext
    ) -> None:
        # gRPC lets in messages up to twice the limit so that this one is named and
        # counted here; larger ones it cuts off itself, before any handler sees them.
        message = (
            f"message of {size:,} bytes from site {site!r} ({context.peer()}), larger "
            f"than {self.max_message_bytes:,} (max_chunk_bytes and its fields): stream cut off"
        )
        self._refuse(message, wire_pb2.TOO_LARGE)
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, message)

    async def accept(self, chunk: wire_pb2.Chunk, site: str, rank: int, peer: str) -> wire_pb2.Ack:
        """Verify one chunk from ``site`` and hand it on, or refuse it: the answer to
        every chunk, whatever its fields hold."""
        payload = chunk.payload  # each read of a bytes field copies it: read once
        try:
            codec = verify(chunk, payload)
            received = ReceivedChunk.from_wire(chunk, payload, codec, site, rank)
            result = self.on_chunk(received)
            if asyncio.iscoroutine(result):
                result = await result
        except ChunkError as exc:
            self._refuse(f"chunk from site {site!r} ({peer}): {exc}", exc.code)
            return _ack(chunk, wire_pb2.Error(code=exc.code, message=str(exc)))
        if result is False:
            # A round over here: a straggler of a round run again, or a replay. Never
            # applied, counted, and acknowledged (nothing for the sender to resend).
            self._refuse(
                f"chunk from site {site!r} ({peer}) of round {chunk.round}, which is over "
                "here: dropped",
                wire_pb2.STALE_ROUND,
                level=logging.INFO,
            )
        return _ack(chunk, None)

    def _check_certificate(
        self, site: str, context: grpc.aio.ServicerContext
    ) -> wire_pb2.Error | None:
        """Under mutual TLS, the caller's certificate (verified by the TLS handshake
        against the job's CA) must name ``site``: a site cannot speak for another,
        and the job's CA must not have revoked it. The caller counts the refusal."""
        if not self.check_certificates:
            return None
        named = certified_sites(context)
        if site in named:
            return self._check_revoked(site, context)
        return wire_pb2.Error(
            code=wire_pb2.WRONG_JOB,
            message=f"{context.peer()} claims site {site!r} but its certificate names "
            f"{sorted(named) or 'no site'}",
        )

    def _check_revoked(self, site: str, context: grpc.aio.ServicerContext) -> wire_pb2.Error | None:
        if self.revocations is None:
            return None
        pem = peer_certificate(context)
        serial = self.revocations.revoked(pem) if pem is not None else None
        if serial is None:
            return None
        return wire_pb2.Error(
            code=wire_pb2.REVOKED,
            message=f"{context.peer()} presents site {site!r}'s certificate with serial "
            f"{serial:x}, which the job's CA revoked ({self.revocations.path})",
        )

    def _refuse(
        self, reason: str, code: int = wire_pb2.WRONG_JOB, level: int = logging.WARNING
    ) -> None:
        self.refused.append(reason)
        kind = wire_pb2.ErrorCode.Name(code)
        self.refusals[kind] += 1
        # One line per kind every LOG_EVERY_S at most: a noisy link or a peer that
        # keeps calling must not drown the log (the counts stay exact).
        now = time.monotonic()
        last, unlogged = self._last_logged.get(kind, (-math.inf, 0))
        if now - last < LOG_EVERY_S:
            self._last_logged[kind] = (last, unlogged + 1)
            return
        self._last_logged[kind] = (now, 0)
        more = f" (and {unlogged} more like it since the last such line)" if unlogged else ""
        log.log(level, "refused: %s%s", reason, more)


def _ack(chunk: wire_pb2.Chunk, error: wire_pb2.Error | None) -> wire_pb2.Ack:
    ack = wire_pb2.Ack(
        round=chunk.round,
        shard=chunk.shard,
        index=chunk.index,
        ok=error is None,
        checksum=chunk.checksum,
    )
    if error is not None:
        ack.error.CopyFrom(error)
    return ack


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """The authentication hook: ``check(metadata)`` returns None to admit a call, or
    the reason to refuse it (UNAUTHENTICATED). Mutual TLS itself is the transport's
    (``TransportSettings.tls``); this hook is for tokens and policies on top."""

    def __init__(self, check: Callable[[dict[str, str]], str | None]) -> None:
        self.check = check

    async def intercept_service(self, continuation: Any, details: grpc.HandlerCallDetails) -> Any:
        reason = self.check(dict(details.invocation_metadata or ()))
        handler = await continuation(details)
        if reason is None or handler is None:
            return handler

        async def deny(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, reason)

        if handler.request_streaming and handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(deny)
        if handler.request_streaming:
            return grpc.stream_unary_rpc_method_handler(deny)
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(deny)
        return grpc.unary_unary_rpc_method_handler(deny)


@dataclass
class MetricsInterceptor(grpc.aio.ServerInterceptor):
    """Counts calls per method (bytes and latency are counted by the engine, per chunk)."""

    calls: dict[str, int] = field(default_factory=dict)

    async def intercept_service(self, continuation: Any, details: grpc.HandlerCallDetails) -> Any:
        self.calls[details.method] = self.calls.get(details.method, 0) + 1
        return await continuation(details)


class PeerServer:
    """A rank's gRPC server: the peer service, the health service, the interceptors."""

    def __init__(
        self,
        identity: Identity,
        sites: Collection[str],
        on_chunk: ChunkSink,
        *,
        settings: TransportSettings | None = None,
        interceptors: Iterable[grpc.aio.ServerInterceptor] = (),
    ) -> None:
        self.settings = settings or TransportSettings()
        self.metrics = MetricsInterceptor()
        self.servicer = PeerServicer(
            identity,
            sites,
            on_chunk,
            check_certificates=self.settings.tls is not None,
            max_streams_per_site=self.settings.max_streams_per_site,
            max_message_bytes=self.settings.max_message_bytes,
            revocations=None if self.settings.tls is None else self.settings.tls.revocations,
        )
        self.servicer.part_bytes = self.settings.max_chunk_bytes
        self.server = grpc.aio.server(
            interceptors=[self.metrics, *interceptors],
            options=self.settings.server_options(),
            maximum_concurrent_rpcs=self.settings.max_calls,
        )
        wire_pb2_grpc.add_PeerServiceServicer_to_server(self.servicer, self.server)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.port: int | None = None

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Listen on ``host:port`` (0: a free port); return the port. Names the address
        when it cannot be bound. Leaves malloc as it is: a process that carries
        chunks should call :func:`isthmus.inter.allocator.keep_freed_memory` first
        (the launchers do), a process-wide choice that is not a library's to make."""
        tls = self.settings.tls
        try:
            if tls is None:
                self.port = self.server.add_insecure_port(f"{host}:{port}")
            else:
                self.port = self.server.add_secure_port(f"{host}:{port}", tls.server_credentials())
        except RuntimeError as exc:
            raise PeerError(
                f"cannot listen on {host}:{port} ({exc}); is the port in use?"
            ) from None
        await self.server.start()
        for service in ("", SERVICE_NAME):
            await self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        return self.port

    async def stop(self, grace_s: float = 1.0) -> None:
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace_s)
