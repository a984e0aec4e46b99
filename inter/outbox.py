"""Reliable delivery of one call's chunks to one peer: resent until acknowledged.

A chunk can fail on the way in two ways. The peer refuses it (its checksum
does not match: corrupted between our encoder and its verifier), or the
stream breaks (a connection reset, a garbled HTTP/2 frame) before the peer
answered. Either way the chunk must arrive, once, unchanged, or the round
fails naming the peer. :func:`send_reliably` keeps every chunk it sent until
the peer acknowledges it and sends the unacknowledged ones again on a new
stream: a refused chunk up to :data:`MAX_REFUSALS` times, a broken or stalled
stream until the round's deadline (a peer that is down is waited for until
then, so a 30-second partition does not end a run). The chunks come from a
lazy source (encoding overlaps sending), which is read exactly once: a resend
never encodes again, so error feedback and the owner's "encode once" stay
exact. The receiver drops a chunk it already placed, so a chunk whose
acknowledgement was lost may arrive twice harmlessly.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field

from isthmus.inter.peer import PeerError
from isthmus.inter.peer_client import PeerClient
from isthmus.proto import wire_pb2

log = logging.getLogger(__name__)

MAX_REFUSALS = 24
"""Refusals of one chunk before it is given up: a checksum that fails this often is
a sender that builds bad chunks, not a noisy link. Broken streams are retried until
the deadline instead.

Each send of a chunk is refused independently with the link's refusal rate q, so
a chunk is given up by chance with probability q**MAX_REFUSALS. The limit must
make that negligible over a whole run, not over one chunk: at 8, the fault
benchmark (q = 0.26: 20% injected, 6% flipped on the wire; 23,000 chunks a run)
expects 0.5 chunks given up a run, and 2 runs in 5 failed. At 24, q = 0.26 gives
1e-14 a chunk and a link that corrupts half of everything 6e-8; a chunk that can
never pass is still given up within 24 round trips."""
REFUSED_CALLS_BELIEVED = 3
"""Times the peer must refuse a call (a wrong job, a denied certificate) before the
refusal is taken as final rather than as a garbled header."""
PREFETCH = 2
"""Chunks read from the source ahead of the stream (each up to max_chunk_bytes)."""
RETRY_PAUSE_S = 0.05
"""Pause before the first retry, doubled on each further one."""

EARLY_PAUSE_S = 0.5
"""Pause before sending chunks again that the peer was not ready for (ROUND_AHEAD)."""

Key = tuple[int, int, int]
"""(round, shard, index): what an acknowledgement names."""


@dataclass
class Delivery:
    """What it took to deliver one call's chunks."""

    resent_chunks: int = 0
    broken_streams: int = 0
    """Streams that failed (a reset, a garbled frame) or stalled, and were replaced."""
    times_refused: Counter[int] = field(default_factory=Counter)
    """How many chunks were refused k times before they passed, by k: a link that
    refuses at random gives a geometric tail, and its end is the margin left to
    MAX_REFUSALS."""


class SendFailed(Exception):
    """The chunks could not be delivered; the message says why."""


class _Outbox:
    """The chunks of one call: pulled from their source once, kept until acknowledged."""

    def __init__(self, chunks: Iterable[wire_pb2.Chunk] | AsyncIterator[wire_pb2.Chunk]) -> None:
        self._source = chunks if isinstance(chunks, AsyncIterator) else as_async(chunks)
        # A task of its own reads the source, PREFETCH chunks ahead: the next chunk
        # is encoded while this one is written, and gRPC cancelling the task that
        # reads a broken stream's requests cannot reach (and kill) the source.
        self._ready: asyncio.Queue[wire_pb2.Chunk | BaseException | None] = asyncio.Queue(PREFETCH)
        self._reader: asyncio.Task[None] | None = None
        self.exhausted = False
        self.unacked: dict[Key, wire_pb2.Chunk] = {}
        self.refusals: dict[Key, int] = {}
        self.resent = 0
        self.early = False
        """The peer said it is not at a chunk's round yet: pause before sending again."""
        self.last_refusal = ""
        self.hopeless = False
        """A chunk was refused MAX_REFUSALS times."""
        self.last_progress = 0.0
        """Loop time of the last acknowledgement, of the stream's start, or of the
        moment chunks went out again after none were (whichever is latest)."""

    async def stream(self) -> AsyncIterator[wire_pb2.Chunk]:
        """The chunks not yet acknowledged, then the rest of the source."""
        for chunk in list(self.unacked.values()):
            self.resent += 1  # counted as it leaves: a stream may break before
            yield chunk
        while not self.exhausted:
            chunk = await self._next()
            if chunk is None:
                return
            if not self.unacked:
                # Nothing was out: the stall clock starts now, not when the stream
                # opened. A stream may wait long for its first chunk (the results
                # stream waits for the contributions), and that wait is no stall.
                self.last_progress = asyncio.get_running_loop().time()
            self.unacked[_key(chunk)] = chunk
            yield chunk

    async def _next(self) -> wire_pb2.Chunk | None:
        if self._reader is None:
            self._reader = asyncio.ensure_future(self._read())
        item = await self._ready.get()  # cancelled while waiting: nothing is taken
        if isinstance(item, BaseException):
            raise item  # the source failed (an encoding error): the caller's to see
        self.exhausted = item is None
        return item

    async def _read(self) -> None:
        try:
            async for chunk in self._source:
                await self._ready.put(chunk)
        except Exception as exc:  # handed to the stream, which raises it
            await self._ready.put(exc)
            return
        await self._ready.put(None)

    def acknowledge(self, ack: wire_pb2.Ack) -> None:
        self.last_progress = asyncio.get_running_loop().time()
        key = (ack.round, ack.shard, ack.index)
        sent = self.unacked.get(key)
        if sent is None or sent.checksum != ack.checksum:
            return  # garbled on the way back, or a duplicate: the chunk stays due
        if ack.ok:
            del self.unacked[key]
        elif ack.error.code == wire_pb2.ROUND_AHEAD:
            # The peer is not at this round yet (catching up): not the chunk's fault.
            self.last_refusal = ack.error.message
            self.early = True
        else:
            self.last_refusal = ack.error.message or "refused without a reason"
            self.refusals[key] = self.refusals.get(key, 0) + 1
            self.hopeless |= self.refusals[key] >= MAX_REFUSALS

    def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()


async def send_reliably(
    client: PeerClient,
    chunks: Iterable[wire_pb2.Chunk] | AsyncIterator[wire_pb2.Chunk],
    *,
    deadline_s: float,
    wrap: Callable[[AsyncIterator[wire_pb2.Chunk]], AsyncIterator[wire_pb2.Chunk]] | None = None,
    connection: int = 0,
) -> Delivery:
    """Deliver ``chunks`` to ``client``'s peer, each acknowledged once, within
    ``deadline_s``; raise :class:`SendFailed` otherwise. ``wrap``: applied to each
    stream on its way out (byte counters, fault injection); ``connection``: which of
    the client's connections carries the streams (a stall redials that one)."""
    loop = asyncio.get_running_loop()
    give_up = loop.time() + deadline_s
    outbox = _Outbox(chunks)
    delivery = Delivery()
    call: asyncio.Future[object] | None = None
    refused_calls = 0
    try:
        for attempt in itertools.count():
            stream = outbox.stream()
            call = asyncio.ensure_future(
                client.exchange(
                    wrap(stream) if wrap is not None else stream,
                    on_ack=outbox.acknowledge,
                    timeout_s=max(0.0, give_up - loop.time()),
                    # After a break, wait for the connection to come back (within
                    # the deadline) rather than fail on the first refused connect.
                    wait_for_ready=attempt > 0,
                    connection=connection,
                )
            )
            try:
                stalled = await _watch(call, outbox, client.settings.stall_s)
            except PeerError as exc:
                # A refusal of the call itself (not of a chunk) is final, but a
                # garbled header can fake one: believe it the third time.
                refused_calls += not exc.transient
                if refused_calls >= REFUSED_CALLS_BELIEVED or loop.time() >= give_up:
                    raise SendFailed(str(exc)) from None
                delivery.broken_streams += 1
                outbox.last_refusal = str(exc)
                log.info(
                    "stream to %s broke (%s); %d chunks to send again",
                    client.address,
                    exc,
                    len(outbox.unacked),
                )
                await asyncio.sleep(min(RETRY_PAUSE_S * 2**attempt, 1.0))
                continue
            if stalled:
                delivery.broken_streams += 1
                outbox.last_refusal = f"no acknowledgement for {client.settings.stall_s:g} s"
                log.warning(
                    "stream to %s stalled (%s); redialling, %d chunks to send again",
                    client.address,
                    outbox.last_refusal,
                    len(outbox.unacked),
                )
                await client.reconnect(connection)
                continue
            if outbox.exhausted and not outbox.unacked:
                delivery.resent_chunks = outbox.resent
                delivery.times_refused.update(outbox.refusals.values())
                return delivery
            if outbox.early and loop.time() < give_up:
                outbox.early = False
                await asyncio.sleep(min(EARLY_PAUSE_S, max(0.0, give_up - loop.time())))
                continue
            if outbox.hopeless:
                raise SendFailed(
                    f"a chunk was refused {MAX_REFUSALS} times; last: {outbox.last_refusal}"
                )
            if loop.time() >= give_up:
                raise SendFailed(
                    f"{len(outbox.unacked)} chunks still not accepted after {deadline_s:g} s; "
                    f"last: {outbox.last_refusal}"
                )
        raise AssertionError("unreachable")
    finally:
        if call is not None:
            call.cancel()
        outbox.close()


async def _watch(call: asyncio.Future[object], outbox: _Outbox, stall_s: float) -> bool:
    """Wait for ``call``; cancel it and return True if chunks are out and none was
    acknowledged for ``stall_s``. Raises what the call raises."""
    loop = asyncio.get_running_loop()
    outbox.last_progress = loop.time()
    while True:
        done, _ = await asyncio.wait({call}, timeout=stall_s / 4)
        if done:
            call.result()
            return False
        if outbox.unacked and loop.time() - outbox.last_progress > stall_s:
            call.cancel()
            await asyncio.gather(call, return_exceptions=True)
            return True


async def as_async(chunks: Iterable[wire_pb2.Chunk]) -> AsyncIterator[wire_pb2.Chunk]:
    """``chunks`` as an async iterator (a source of either kind is read the same way)."""
    for chunk in chunks:
        yield chunk


def _key(chunk: wire_pb2.Chunk) -> Key:
    return (chunk.round, chunk.shard, chunk.index)
