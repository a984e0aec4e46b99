"""Outgoing chunks: encoding on a worker thread, reliable delivery, sends that outlive their round.

Encoding runs on one thread (torch releases the GIL), so the event loop keeps
the streams moving meanwhile: chunk k+1 is encoded while k is sent. Each
stream goes through :func:`isthmus.inter.outbox.send_reliably`, which sends a
chunk again when it is refused as corrupted or lost with a broken stream.

A round is over for this site once its result is in place; its last chunks
may still be on their way (:meth:`Outgoing.outlive`), and :meth:`Outgoing.flush`
waits for them before the engine closes.

Values may live on any device: each chunk is encoded there and only its
bytes come to the host, on the encoder thread (see :mod:`isthmus.inter.staging`),
so a GPU's copy of chunk k+1 overlaps the sending of chunk k as its encoding does.

Faults for tests come in from outside as a :data:`ChunkFilter` (see
:mod:`.faults`): applied to each chunk as it goes on the wire, after its
checksum. Without one (the default) the stream is not wrapped at all.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
from collections import Counter
from collections.abc import AsyncIterator, Callable, Coroutine, Iterable, Mapping, Sequence
from typing import Any

import torch

from isthmus.inter.allreduce.rounds import RoundError, payload_size
from isthmus.inter.chunks import chunk_ranges, encode_chunk, to_encoded, values_per_chunk
from isthmus.inter.codecs import Codec
from isthmus.inter.outbox import Delivery, SendFailed, as_async, send_reliably
from isthmus.inter.peer_client import PeerClient
from isthmus.inter.staging import Staging
from isthmus.proto import wire_pb2

log = logging.getLogger(__name__)

ChunkFilter = Callable[[str, wire_pb2.Chunk], wire_pb2.Chunk]
"""Applied to each outgoing chunk as it goes on the wire to a site, after its
checksum: ``(site, chunk)`` -> the chunk to send (the same, or an altered copy:
a fault for tests, see :mod:`.faults`)."""


class Outgoing:
    """What one engine sends: its encoder thread, its sends and their counters."""

    def __init__(
        self,
        clients: Mapping[str, PeerClient],
        *,
        lane: int = 0,
        chunk_filter: ChunkFilter | None = None,
    ) -> None:
        """``clients``: the engine's sessions, site -> client (the engine adds to it)."""
        self.clients = clients
        self.lane = lane
        self.chunk_filter = chunk_filter
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="encode")
        self.bytes_sent_to: dict[str, int] = {}
        """Payload bytes sent to each site over this engine's life (per link, for telemetry)."""
        self.resent_chunks = 0
        """Chunks sent again: refused as corrupted, or unanswered when a stream broke."""
        self.broken_streams = 0
        self.times_refused: Counter[int] = Counter()
        """Chunks refused k times before they passed, by k (see MAX_REFUSALS)."""
        self.failed_deliveries = 0
        """Sends that failed after their round was over here (each logged)."""
        self.deliveries: dict[asyncio.Future[None], str] = {}
        """Sends of rounds that are over here, still waiting for acknowledgements: what
        each is (round and site), for the log."""

    async def encode(
        self, codec: Codec, values: torch.Tensor, *, staging: Staging | None = None, **where: int
    ) -> wire_pb2.Chunk:
        """One chunk, encoded on the worker thread (on the values' device)."""
        encode = functools.partial(
            encode_chunk, codec, values, weight=1.0, lane=self.lane, staging=staging, **where
        )
        return await asyncio.get_running_loop().run_in_executor(self._pool, encode)

    async def encoded_chunks(
        self,
        codec: Codec,
        max_chunk_bytes: int,
        values: torch.Tensor,
        *,
        round: int,
        shard: int,
        sent: list[int],
        lost: torch.Tensor | None = None,
        staging: Staging | None = None,
    ) -> AsyncIterator[wire_pb2.Chunk]:
        """The chunks of ``values``, each encoded on the worker thread just before it
        is needed; adds their payload sizes to ``sent``. ``lost`` (as long as
        ``values``) receives what the codec lost: ``values - decode(encode(values))``."""
        loop = asyncio.get_running_loop()
        ranges = chunk_ranges(values.numel(), values_per_chunk(codec, max_chunk_bytes))
        for index, (a, b) in enumerate(ranges):
            encode = functools.partial(
                encode_chunk,
                codec,
                values[a:b],
                round=round,
                shard=shard,
                offset=a,
                index=index,
                count=len(ranges),
                weight=1.0,
                lane=self.lane,
                staging=staging,
            )
            chunk = await loop.run_in_executor(self._pool, encode)
            if lost is not None:
                loss = functools.partial(codec_loss, chunk, codec, values, lost, staging)
                await loop.run_in_executor(self._pool, loss)
            sent.append(payload_size(chunk))
            yield chunk

    async def send(
        self,
        site: str,
        chunks: Iterable[wire_pb2.Chunk] | AsyncIterator[wire_pb2.Chunk],
        *,
        round: int,
        deadline_s: float,
        handed_over: asyncio.Event | None = None,
    ) -> None:
        """Deliver ``chunks`` to ``site``: a chunk refused as corrupted, or lost with a
        broken stream, is sent again (:mod:`isthmus.inter.outbox`). With several
        connections to the site, one stream on each takes the chunks as they come
        (a chunk stays with the stream that took it, resends included).
        ``handed_over`` is set once gRPC has taken the last chunk on every
        connection (or each one's first stream gave up)."""
        client = self.clients[site]
        chunk_filter = self.chunk_filter
        connections = client.connections
        taken = [asyncio.Event() for _ in range(connections)] if handed_over else []

        def wrap_for(connection: int) -> Callable[[AsyncIterator[wire_pb2.Chunk]], Any]:
            def wrap(stream: AsyncIterator[wire_pb2.Chunk]) -> AsyncIterator[wire_pb2.Chunk]:
                counted = self._on_the_wire(site, stream)
                if chunk_filter is not None:
                    counted = _filtered(site, counted, chunk_filter)
                return _then_set(counted, taken[connection]) if taken else counted

            return wrap

        source = _Dealt(chunks) if connections > 1 else None
        sends = [
            send_reliably(
                client,
                source.part() if source is not None else chunks,
                deadline_s=deadline_s,
                wrap=wrap_for(i),
                connection=i,
            )
            for i in range(connections)
        ]
        handing = asyncio.ensure_future(_all_set(taken, handed_over)) if handed_over else None
        try:
            deliveries = await _all_or_none(sends)
        except SendFailed as exc:
            raise RoundError(
                site, f"round {round}: sending to site {site!r} failed: {exc}"
            ) from None
        finally:
            if handing is not None:
                handing.cancel()
        for delivery in deliveries:
            self.resent_chunks += delivery.resent_chunks
            self.broken_streams += delivery.broken_streams
            self.times_refused.update(delivery.times_refused)

    async def _on_the_wire(
        self, site: str, chunks: AsyncIterator[wire_pb2.Chunk]
    ) -> AsyncIterator[wire_pb2.Chunk]:
        """Count what leaves for ``site``."""
        async for chunk in chunks:
            self.bytes_sent_to[site] = self.bytes_sent_to.get(site, 0) + payload_size(chunk)
            yield chunk

    def outlive(self, round: int, sends: Sequence[tuple[str, asyncio.Future[None]]]) -> None:
        """Let ``sends`` of ``round`` finish after the round returns.

        A round is over for this site once its result is in place: waiting for
        the acknowledgements of its last chunks too would add a one-way latency
        to every round. The chunks are kept and resent (:mod:`isthmus.inter.outbox`)
        until acknowledged all the same. A send that fails now fails its peer's
        round, which names this site; here it is logged and counted."""
        for site, task in sends:
            if task.done():
                self._delivered(round, task)
            else:
                self.deliveries[task] = f"round {round} to site {site!r}"
                task.add_done_callback(functools.partial(self._delivered, round))

    def _delivered(self, round: int, task: asyncio.Future[None]) -> None:
        self.deliveries.pop(task, None)
        if task.cancelled():
            return
        error = task.exception()
        if error is not None:
            self.failed_deliveries += 1
            log.warning(
                "round %d, over here, could not deliver all its chunks: %s; "
                "that site's round fails by its deadline",
                round,
                error,
            )

    async def flush(self, timeout_s: float | None = None) -> None:
        """Wait until the chunks of rounds that are over here are acknowledged (or
        their delivery failed, which is logged); after ``timeout_s``, stop waiting
        and cancel the rest, naming them."""
        if not self.deliveries:
            return
        pending = dict(self.deliveries)
        _, late = await asyncio.wait(pending, timeout=timeout_s)
        if late:
            log.warning(
                "sends of rounds that are over here not acknowledged within %g s, given up: %s",
                timeout_s,
                ", ".join(sorted(pending[task] for task in late)),
            )
            for task in late:
                task.cancel()
            await asyncio.gather(*late, return_exceptions=True)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def codec_loss(
    chunk: wire_pb2.Chunk,
    codec: Codec,
    values: torch.Tensor,
    lost: torch.Tensor,
    staging: Staging | None = None,
) -> None:
    """``lost[chunk] = values[chunk] - decode(chunk)``: what encoding lost there
    (decoded straight into ``lost``, on its device)."""
    encoded = to_encoded(chunk, chunk.payload)
    span = slice(chunk.offset, chunk.offset + encoded.count)
    decoded = codec.decode(encoded, out=lost[span], staging=staging)
    torch.sub(values[span], decoded, out=decoded)


async def unless_a_send_fails(
    work: Coroutine[Any, Any, None], sends: Sequence[asyncio.Future[None]]
) -> None:
    """Run ``work``, unless one of ``sends`` fails first: then cancel it and raise that
    failure. A chunk this round's result depends on that cannot be delivered (its
    peer refused it again and again, or stayed away past the deadline) dooms the
    round; saying so now, naming the link, beats waiting out the deadline for
    results that cannot come and blaming the peer that waited for this site."""
    task = asyncio.ensure_future(work)
    watching: set[asyncio.Future[None]] = {task, *sends}
    try:
        while True:
            done, watching = await asyncio.wait(watching, return_when=asyncio.FIRST_COMPLETED)
            if task in done:
                return task.result()
            for send in done:
                error = None if send.cancelled() else send.exception()
                if error is not None:
                    raise error
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


async def drain(
    queue: asyncio.Queue[wire_pb2.Chunk | None], *, after: asyncio.Event | None = None
) -> AsyncIterator[wire_pb2.Chunk]:
    """The chunks put on ``queue`` until None, once ``after`` (if any) is set: one
    peer's all-gather stream, behind its reduce-scatter stream (direct), or one
    peer's copy of this site's contribution (gather)."""
    if after is not None:
        await after.wait()
    while (chunk := await queue.get()) is not None:
        yield chunk


class _Dealt:
    """One lazy chunk source read by the streams of several connections: each chunk
    goes to the stream that asks first, so a connection whose window opens sooner
    takes more, and each chunk is still read (encoded) exactly once."""

    def __init__(self, chunks: Iterable[wire_pb2.Chunk] | AsyncIterator[wire_pb2.Chunk]) -> None:
        self._source = chunks if isinstance(chunks, AsyncIterator) else as_async(chunks)
        self._lock = asyncio.Lock()
        self._ended = False

    async def part(self) -> AsyncIterator[wire_pb2.Chunk]:
        """One connection's share, as it asks for chunks."""
        while True:
            async with self._lock:  # one reader at a time: an async generator allows no more
                if self._ended:
                    return
                try:
                    chunk = await anext(self._source)
                except StopAsyncIteration:
                    self._ended = True
                    return
            yield chunk


async def _all_or_none(sends: list[Coroutine[Any, Any, Delivery]]) -> list[Delivery]:
    """Every send's delivery; the first to fail cancels the others and is raised."""
    if len(sends) == 1:
        return [await sends[0]]
    tasks = [asyncio.ensure_future(send) for send in sends]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()


async def _all_set(events: list[asyncio.Event], then: asyncio.Event) -> None:
    for event in events:
        await event.wait()
    then.set()


async def _then_set(
    chunks: AsyncIterator[wire_pb2.Chunk], done: asyncio.Event
) -> AsyncIterator[wire_pb2.Chunk]:
    """``chunks``, then ``done`` set once the last was taken (or the stream ended early:
    what is left waits for a new stream, and holding others back for it helps no one)."""
    try:
        async for chunk in chunks:
            yield chunk
    finally:
        done.set()


async def _filtered(
    site: str, chunks: AsyncIterator[wire_pb2.Chunk], chunk_filter: ChunkFilter
) -> AsyncIterator[wire_pb2.Chunk]:
    async for chunk in chunks:
        yield chunk_filter(site, chunk)
