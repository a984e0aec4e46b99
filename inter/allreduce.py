"""The cross-site all-reduce: a weighted average of a flat float32 tensor over sites.

This first algorithm is ``direct`` (every site owns a slice): in the
reduce-scatter phase each site sends slice j of its tensor to the owner of j;
the owner reduces the contributions in a fixed order (sorted site names) and
encodes the result *once*; in the all-gather phase it sends those same bytes
to every site and decodes them itself too. Every site therefore ends with
bitwise-identical output, whatever the codec. A value is encoded twice on its
way (once as a contribution, once as the owner's result), so the end-to-end
error is at most two of the codec's bounds (see ``Codec.max_error``): the
contributions' weighted bounds E, plus the bound of the second encode, taken for
values of magnitude up to |exact average| + E (a blockwise codec's step follows
the block absmax of what the owner reduced, which the first encode can raise).

The caller decides which sites take part and with what weights (the strategy
seals that decision for the round); the engine never decides membership. A
contribution that is not finite, or of the wrong size, is refused with an
error naming the site; a peer that does not deliver by the deadline fails the
round with an error naming the site and its address.

Wire tags: reduce-scatter chunks carry ``shard = j``, all-gather chunks carry
``shard = S + j``, both with the caller's ``round``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import math
import random
from collections import Counter
from collections.abc import AsyncIterator, Coroutine, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from isthmus.inter.chunks import (
    ChunkError,
    ReceivedChunk,
    chunk_ranges,
    encode_chunk,
    flip_payload_bit,
    to_encoded,
    to_wire,
    values_per_chunk,
)
from isthmus.inter.codecs import Codec
from isthmus.inter.outbox import SendFailed, send_reliably
from isthmus.inter.peer import Identity, PeerClient, PeerError, PeerServer
from isthmus.inter.transport import TransportSettings
from isthmus.proto import wire_pb2
from isthmus.sim.cost import LinkLookup, choose

log = logging.getLogger(__name__)

MAX_ROUNDS_AHEAD = 16
"""How many rounds past its own a rank holds chunks for. Peers are at most a round
or two ahead (every round needs every participant); more is a peer out of step."""
LENIENT_HELLO_S = 5.0
"""How long a lenient connect waits for each peer's handshake."""
FLUSH_ON_CLOSE_S = 20.0
"""How long :meth:`CrossSiteAllReduce.close` waits for the acknowledgements of chunks
sent by rounds that are over here (a peer may still need them to finish its round)."""


class RoundError(RuntimeError):
    """A round could not complete; ``site`` names the site at fault."""

    def __init__(self, site: str, message: str) -> None:
        super().__init__(message)
        self.site = site


@dataclass(frozen=True)
class RoundStats:
    """What one all-reduce moved over the WAN from this rank."""

    bytes_sent: int
    bytes_received: int
    seconds: float
    phases: dict[str, float] = field(default_factory=dict)
    """Seconds from the round's start to each milestone this site passed, in order
    (the direct algorithm): ``contributions``, every other site's share of this
    site's slice in place; ``results``, every other slice's result in place, the
    average ready and the round over here."""


def all_finite(values: torch.Tensor) -> bool:
    """No NaN or Inf in ``values``. One reduction on the common path: a finite sum
    means every value is finite (NaN and Inf propagate into it); only an
    infinite sum, which finite values can also reach by overflow, is checked
    value by value."""
    if values.numel() == 0:
        return True
    if math.isfinite(float(values.sum())):
        return True
    return bool(torch.isfinite(values).all())


def slice_bounds(count: int, parts: int) -> list[tuple[int, int]]:
    """Split ``count`` values into ``parts`` contiguous slices, sizes differing by <= 1."""
    base, extra = divmod(count, parts)
    bounds, start = [], 0
    for i in range(parts):
        stop = start + base + (1 if i < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


class _Incoming:
    """The chunks of one (round, shard, site) arriving into one buffer.

    Chunks may arrive before this rank has entered the round (a faster peer):
    they wait, encoded, until :meth:`open` gives the buffer its size."""

    def __init__(self) -> None:
        self.buffer: torch.Tensor | None = None
        self.pending: list[ReceivedChunk] = []
        self.seen: set[int] = set()
        self.count: int | None = None
        self.done = asyncio.Event()
        self.progress = asyncio.Event()
        """Set whenever a chunk lands (waiters clear it before waiting)."""
        self.error: RoundError | None = None
        self.kept: dict[int, ReceivedChunk] = {}
        """With ``keep``: the chunks themselves, to forward them unchanged (ring)."""
        self._keep = False

    def open(self, size: int, *, keep: bool = False, into: torch.Tensor | None = None) -> None:
        """Give the chunks a buffer of ``size`` values: ``into`` (where the caller wants
        them, e.g. their place in the round's output: no copy after), or a new one."""
        self._keep = keep
        if into is not None and into.numel() != size:
            raise ValueError(f"buffer of {into.numel()} values for a shard of {size}")
        self.buffer = torch.empty(size, dtype=torch.float32) if into is None else into
        for chunk in self.pending:
            self._place(chunk)
        self.pending.clear()

    def add(self, chunk: ReceivedChunk) -> None:
        if self.count is not None and chunk.count != self.count:
            raise ChunkError(
                wire_pb2.WRONG_SHAPE,
                f"chunk {chunk.index} says the shard has {chunk.count} chunks, earlier "
                f"chunks said {self.count}",
            )
        if chunk.index in self.seen or self.error is not None:
            return  # a re-sent chunk already placed
        self.count = chunk.count
        if self.buffer is None:
            self.pending.append(chunk)
        else:
            self._place(chunk)
        self.seen.add(chunk.index)
        self.progress.set()
        if len(self.seen) == self.count:
            self.done.set()

    def _place(self, chunk: ReceivedChunk) -> None:
        assert self.buffer is not None
        if self._keep:
            self.kept[chunk.index] = chunk
        try:
            values = chunk.decode_into(self.buffer)
        except ChunkError as exc:
            self._fail(RoundError(chunk.site, f"round {chunk.round}: site {chunk.site!r}: {exc}"))
            return
        if not all_finite(values):
            bad = int((~torch.isfinite(values)).sum())
            self._fail(
                RoundError(
                    chunk.site,
                    f"round {chunk.round}: site {chunk.site!r} sent {bad} NaN/Inf values; refused",
                )
            )

    def _fail(self, error: RoundError) -> None:
        self.error = error
        self.progress.set()
        self.done.set()


class CrossSiteAllReduce:
    """One rank's end of the all-reduce with its counterparts in the other sites."""

    def __init__(
        self,
        identity: Identity,
        peers: Mapping[str, str],
        *,
        codec: Codec | None = None,
        settings: TransportSettings | None = None,
        deadline_s: float = 60.0,
        link_costs: LinkLookup | None = None,
        uplink_bytes_per_s: Mapping[str, float] | None = None,
        lane: int = 0,
        server: PeerServer | None = None,
        corrupt_payloads: float = 0.0,
    ) -> None:
        """``peers``: site -> address of this rank's counterpart there. ``link_costs``
        (the same on every site: configured, or measured and sealed by the strategy)
        lets ``algorithm="auto"`` pick the algorithm the cost model predicts fastest.

        ``lane`` and ``server``: a rank that owns several lanes (see
        :mod:`isthmus.inter.lanes`) runs one engine per lane on one shared server,
        which hands each engine the chunks of its lane; ``peers`` are then the
        lane's counterparts. Without ``server`` the engine runs its own.

        ``corrupt_payloads``: a fault for tests and the fault benchmark: this
        fraction of outgoing chunks gets a bit flipped after its checksum was
        computed (seeded by site, rank and lane). Receivers must refuse every one."""
        if not 0.0 <= corrupt_payloads <= 1.0:
            raise ValueError(f"corrupt_payloads must be in [0, 1], got {corrupt_payloads}")
        self.link_costs = link_costs
        self.uplink_bytes_per_s = dict(uplink_bytes_per_s or {})
        self.last_algorithm: str | None = None
        self.identity = identity
        self.peers = dict(peers)
        self.codec = codec or Codec()
        self.settings = settings or TransportSettings()
        self.deadline_s = deadline_s
        self.lane = lane
        self._owns_server = server is None
        if server is None:
            sites = {identity.site, *self.peers}
            server = PeerServer(identity, sites, self.receive, settings=self.settings)
        self.server = server
        self.clients: dict[str, PeerClient] = {}
        self._incoming: dict[tuple[int, int, str], _Incoming] = {}
        self._active: list[int] = []
        """Rounds this engine is running now (a list: a round may run twice at once
        only by mistake, and then both must finish before it is forgotten)."""
        self._next_floor = 0
        # Encoding runs on a thread (torch releases the GIL), so the event loop
        # keeps the streams moving meanwhile: chunk k+1 is encoded while k is sent.
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="encode")
        self.last: RoundStats | None = None
        self.bytes_sent_to: dict[str, int] = {}
        """Payload bytes sent to each site over this engine's life (per link, for telemetry)."""
        self._warned_ring = False
        self._residuals: dict[str, torch.Tensor] = {}
        """Error feedback: per vector (the caller's key), what the codec lost of this
        site's last contribution, added to the next one."""
        self._deliveries: dict[asyncio.Future[None], str] = {}
        """Sends of rounds that are over here, still waiting for acknowledgements: what
        each is (round and site), for the log."""
        self.failed_deliveries = 0
        """Sends that failed after their round was over here (each logged)."""
        self.resent_chunks = 0
        """Chunks sent again: refused as corrupted, or unanswered when a stream broke."""
        self.broken_streams = 0
        self.times_refused: Counter[int] = Counter()
        """Chunks refused k times before they passed, by k (see MAX_REFUSALS)."""
        self.corrupt_payloads = corrupt_payloads
        self.corrupted_on_purpose = 0
        self._faults = random.Random(f"{identity.site}/{identity.rank}/{lane}")

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        return await self.server.start(host, port)

    def feedback_state(self, *, copy: bool = True) -> dict[str, torch.Tensor]:
        """The error-feedback residuals, per vector: part of a checkpoint taken
        between rounds (with a lossy codec, resuming without them would differ).
        ``copy=False``: the residual tensors themselves, a snapshot all the same,
        since a round replaces a vector's residual and never changes it in place."""
        return {name: r.clone() if copy else r for name, r in self._residuals.items()}

    def load_feedback_state(self, residuals: Mapping[str, torch.Tensor]) -> None:
        self._residuals = {name: r.clone() for name, r in residuals.items()}

    async def connect(self, *, lenient: bool = False) -> None:
        """Open a session with every peer (handshake checks job, protocol, layout).
        ``lenient``: a peer that does not answer within ``LENIENT_HELLO_S``, or
        refuses, is kept without a handshake (a site rejoining a run where others may
        be down, or not know it yet: the first exchange with it tries again)."""
        for site, address in self.peers.items():
            client = PeerClient(
                self.identity,
                address,
                settings=self.settings,
                deadline_s=self.deadline_s,
                peer_site=site,
            )
            try:
                if lenient:
                    client.deadline_s = min(self.deadline_s, LENIENT_HELLO_S)
                await client.hello()
            except PeerError as exc:
                if not lenient:
                    await client.close()
                    raise RoundError(site, f"site {site!r}: {exc}") from None
                # A site added to the job is refused until the others have heard of
                # it; a real mismatch is refused again at the first exchange.
                log.warning("site %r does not answer yet (%s); going on without it", site, exc)
            finally:
                client.deadline_s = self.deadline_s
            self.clients[site] = client

    def add_peer(self, site: str, address: str) -> None:
        """A site added to the job while it runs: its session opens with the first
        exchange (it is not a participant of any round before a view makes it one)."""
        if site in self.clients:
            return
        self.peers[site] = address
        self.clients[site] = PeerClient(
            self.identity,
            address,
            settings=self.settings,
            deadline_s=self.deadline_s,
            peer_site=site,
        )

    async def close(self) -> None:
        await self.flush(FLUSH_ON_CLOSE_S)
        for client in self.clients.values():
            await client.close()
        if self._owns_server:
            await self.server.stop()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _outlive(self, round: int, sends: Sequence[tuple[str, asyncio.Future[None]]]) -> None:
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
                self._deliveries[task] = f"round {round} to site {site!r}"
                task.add_done_callback(functools.partial(self._delivered, round))

    def _delivered(self, round: int, task: asyncio.Future[None]) -> None:
        self._deliveries.pop(task, None)
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
        if not self._deliveries:
            return
        pending = dict(self._deliveries)
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

    def receive(self, chunk: ReceivedChunk) -> None:
        """Take a verified chunk of this engine's lane from the server; raise
        :class:`ChunkError` to refuse one that no round can use."""
        floor = self._floor()
        if chunk.round < floor:
            return  # a straggler of a round that is over: nobody waits for it
        if chunk.round > floor + MAX_ROUNDS_AHEAD:
            # Chunks of rounds not yet open are held until they open: bound how far
            # ahead, so a peer out of step (or a bad round number) cannot fill memory.
            raise ChunkError(
                wire_pb2.ROUND_AHEAD,
                f"chunk of round {chunk.round}, but this site is at round {floor}; more "
                f"than {MAX_ROUNDS_AHEAD} rounds ahead; send it again later",
            )
        key = (chunk.round, chunk.shard, chunk.site)
        self._incoming.setdefault(key, _Incoming()).add(chunk)

    def _expect(
        self,
        round: int,
        shard: int,
        site: str,
        size: int,
        *,
        keep: bool = False,
        into: torch.Tensor | None = None,
    ) -> _Incoming:
        incoming = self._incoming.setdefault((round, shard, site), _Incoming())
        incoming.open(size, keep=keep, into=into)
        return incoming

    async def _wait_for(
        self, round: int, shard: int, site: str, incoming: _Incoming, deadline: float
    ) -> torch.Tensor:
        remaining = deadline - asyncio.get_running_loop().time()
        try:
            await asyncio.wait_for(incoming.done.wait(), max(0.0, remaining))
        except TimeoutError:
            raise self._late(round, site, incoming) from None
        finally:
            self._incoming.pop((round, shard, site), None)
        if incoming.error is not None:
            raise incoming.error
        assert incoming.buffer is not None
        return incoming.buffer

    def _late(self, round: int, site: str, incoming: _Incoming) -> RoundError:
        # How far it got tells a dead peer (nothing) from a stuck chunk (all but one).
        of = "?" if incoming.count is None else incoming.count
        return RoundError(
            site,
            f"round {round}: site {site!r} ({self.peers.get(site)}) did not deliver within "
            f"{self.deadline_s:g} s ({len(incoming.seen)} of {of} chunks came); it is down, "
            "partitioned or slow",
        )

    async def _wait_chunk(
        self, round: int, site: str, incoming: _Incoming, index: int, deadline: float
    ) -> None:
        """Until chunk ``index`` from ``site`` is in place (or the round fails)."""
        loop = asyncio.get_running_loop()
        while index not in incoming.seen or incoming.buffer is None:
            if incoming.error is not None:
                raise incoming.error
            incoming.progress.clear()
            remaining = deadline - loop.time()
            try:
                await asyncio.wait_for(incoming.progress.wait(), max(0.0, remaining))
            except TimeoutError:
                raise self._late(round, site, incoming) from None
        if incoming.error is not None:
            raise incoming.error

    async def _encode(self, values: torch.Tensor, **where: int) -> wire_pb2.Chunk:
        """One chunk, encoded on the worker thread."""
        encode = functools.partial(
            encode_chunk, self.codec, values, weight=1.0, lane=self.lane, **where
        )
        return await asyncio.get_running_loop().run_in_executor(self._pool, encode)

    async def _encoded_chunks(
        self,
        values: torch.Tensor,
        *,
        round: int,
        shard: int,
        sent: list[int],
        lost: torch.Tensor | None = None,
    ) -> AsyncIterator[wire_pb2.Chunk]:
        """The chunks of ``values``, each encoded on the worker thread just before it
        is needed; adds their payload sizes to ``sent``. ``lost`` (as long as
        ``values``) receives what the codec lost: ``values - decode(encode(values))``."""
        loop = asyncio.get_running_loop()
        ranges = chunk_ranges(
            values.numel(), values_per_chunk(self.codec, self.settings.max_chunk_bytes)
        )
        for index, (a, b) in enumerate(ranges):
            encode = functools.partial(
                encode_chunk,
                self.codec,
                values[a:b],
                round=round,
                shard=shard,
                offset=a,
                index=index,
                count=len(ranges),
                weight=1.0,
                lane=self.lane,
            )
            chunk = await loop.run_in_executor(self._pool, encode)
            if lost is not None:
                await loop.run_in_executor(self._pool, _codec_loss, chunk, self.codec, values, lost)
            sent.append(_payload_size(chunk))
            yield chunk

    async def _send(
        self,
        site: str,
        chunks: Iterable[wire_pb2.Chunk] | AsyncIterator[wire_pb2.Chunk],
        round: int,
        *,
        handed_over: asyncio.Event | None = None,
    ) -> None:
        """Deliver ``chunks`` to ``site``: a chunk refused as corrupted, or lost with a
        broken stream, is sent again (:mod:`isthmus.inter.outbox`). ``handed_over`` is
        set once gRPC has taken the last chunk (or the first stream gave up)."""

        def wrap(stream: AsyncIterator[wire_pb2.Chunk]) -> AsyncIterator[wire_pb2.Chunk]:
            counted = self._on_the_wire(site, stream)
            return counted if handed_over is None else _then_set(counted, handed_over)

        try:
            delivery = await send_reliably(
                self.clients[site], chunks, deadline_s=self.deadline_s, wrap=wrap
            )
        except SendFailed as exc:
            raise RoundError(
                site, f"round {round}: sending to site {site!r} failed: {exc}"
            ) from None
        self.resent_chunks += delivery.resent_chunks
        self.broken_streams += delivery.broken_streams
        self.times_refused.update(delivery.times_refused)

    async def _on_the_wire(
        self, site: str, chunks: AsyncIterator[wire_pb2.Chunk]
    ) -> AsyncIterator[wire_pb2.Chunk]:
        """Count what leaves for ``site``; with ``corrupt_payloads``, flip a bit of that
        fraction of chunks after their checksum was computed (a fault for tests)."""
        async for chunk in chunks:
            self.bytes_sent_to[site] = self.bytes_sent_to.get(site, 0) + _payload_size(chunk)
            if self.corrupt_payloads and self._faults.random() < self.corrupt_payloads:
                chunk = flip_payload_bit(chunk, self._faults)
                self.corrupted_on_purpose += 1
            yield chunk

    async def _ring(
        self,
        flat: torch.Tensor,
        *,
        round: int,
        sites: list[str],
        weights: Mapping[str, float],
        bounds: list[tuple[int, int]],
        started: float,
        deadline: float,
    ) -> torch.Tensor:
        """Ring all-reduce, pipelined by chunks. Site i sends only to its successor.

        Reduce-scatter, step t = 0 .. S-2: send segment (i - t) mod S, the sum so far
        of this site's share and what came from the predecessor at step t - 1.
        After it, site i holds segment (i + 1) mod S complete; it encodes that once.
        All-gather, step t: send segment (i + 1 - t) mod S; from step 1 on these are
        the predecessor's chunks forwarded unchanged, so every site decodes the same
        bytes. Chunk k of a step leaves as soon as chunk k of the previous step is in.
        """
        me = self.identity.site
        n = len(sites)
        i = sites.index(me)
        succ, pred = sites[(i + 1) % n], sites[(i - 1) % n]
        total = sum(weights[s] for s in sites)
        local = flat * (weights[me] / total)  # a scaled copy: the ring sums shares
        per_chunk = values_per_chunk(self.codec, self.settings.max_chunk_bytes)

        def seg(k: int) -> tuple[int, int]:
            return bounds[k % n]

        def ranges(k: int) -> list[tuple[int, int]]:
            lo, hi = seg(k)
            return chunk_ranges(hi - lo, per_chunk)

        rs_in = {
            t: self._expect(round, (i - t - 1) % n, pred, seg(i - t - 1)[1] - seg(i - t - 1)[0])
            for t in range(n - 1)
        }
        ag_in = {
            t: self._expect(round, n + (i - t) % n, pred, seg(i - t)[1] - seg(i - t)[0], keep=True)
            for t in range(n - 1)
        }
        out = torch.empty_like(flat)
        sent: list[int] = []
        owned_segment = (i + 1) % n
        owned: list[wire_pb2.Chunk] = []
        owned_ready = asyncio.Event()

        async def reduce_scatter() -> AsyncIterator[wire_pb2.Chunk]:
            for t in range(n - 1):
                segment = (i - t) % n
                lo, _ = seg(segment)
                spans = ranges(segment)
                for index, (c_lo, c_hi) in enumerate(spans):
                    part = local[lo + c_lo : lo + c_hi]
                    if t > 0:
                        await self._wait_chunk(round, pred, rs_in[t - 1], index, deadline)
                        part = rs_in[t - 1].buffer[c_lo:c_hi] + part  # type: ignore[index]
                    chunk = await self._encode(
                        part,
                        round=round,
                        shard=segment,
                        offset=c_lo,
                        index=index,
                        count=len(spans),
                    )
                    sent.append(_payload_size(chunk))
                    yield chunk

        async def reduce_owned() -> None:
            # The last reduce-scatter step brings segment (i + 1) % n: add this share.
            lo, hi = seg(owned_segment)
            spans = ranges(owned_segment)
            for index, (c_lo, c_hi) in enumerate(spans):
                await self._wait_chunk(round, pred, rs_in[n - 2], index, deadline)
                part = rs_in[n - 2].buffer[c_lo:c_hi] + local[lo + c_lo : lo + c_hi]  # type: ignore[index]
                chunk = await self._encode(
                    part,
                    round=round,
                    shard=n + owned_segment,
                    offset=c_lo,
                    index=index,
                    count=len(spans),
                )
                _own_chunk(chunk, self.codec).decode_into(out[lo:hi])
                owned.append(chunk)
                owned_ready.set()

        async def all_gather() -> AsyncIterator[wire_pb2.Chunk]:
            count = len(ranges(owned_segment))
            for index in range(count):
                while len(owned) <= index:
                    owned_ready.clear()
                    await owned_ready.wait()
                sent.append(_payload_size(owned[index]))
                yield owned[index]
            for t in range(1, n - 1):
                segment = (i + 1 - t) % n
                incoming = ag_in[t - 1]
                for index in range(len(ranges(segment))):
                    await self._wait_chunk(round, pred, incoming, index, deadline)
                    chunk = to_wire(incoming.kept[index])
                    sent.append(_payload_size(chunk))
                    yield chunk

        tasks = [
            asyncio.ensure_future(self._send(succ, reduce_scatter(), round)),
            asyncio.ensure_future(reduce_owned()),
            asyncio.ensure_future(self._send(succ, all_gather(), round)),
        ]

        async def collect() -> None:
            for t in range(n - 1):
                segment = (i - t) % n
                lo, hi = seg(segment)
                out[lo:hi] = await self._wait_for(round, n + segment, pred, ag_in[t], deadline)
            await tasks[1]  # this site's own segment, reduced and decoded into ``out``

        try:
            # Every segment travels the whole ring: a send that fails dooms the round.
            await _unless_a_send_fails(collect(), [tasks[0], tasks[2]])
            for t in range(n - 1):
                self._incoming.pop((round, (i - t - 1) % n, pred), None)
        except BaseException:
            for task in tasks:
                task.cancel()
            for t in range(n - 1):
                self._incoming.pop((round, (i - t - 1) % n, pred), None)
            raise
        self._outlive(round, [(succ, tasks[0]), (succ, tasks[2])])
        # Every step brought one segment from the predecessor, in each phase.
        received = 4 * sum(
            seg(k)[1] - seg(k)[0] for t in range(n - 1) for k in ((i - t - 1) % n, (i - t) % n)
        )
        loop = asyncio.get_running_loop()
        self.last = RoundStats(sum(sent), received, loop.time() - started)
        return out

    async def allreduce(
        self,
        tensor: torch.Tensor,
        *,
        round: int,
        participants: Sequence[str],
        weights: Mapping[str, float],
        algorithm: str = "direct",
        feedback: str | None = None,
    ) -> torch.Tensor:
        """The weighted average of ``tensor`` over ``participants`` (this site among them).

        ``feedback``: error feedback for a lossy codec, keyed by this name (one per
        vector the caller sends again and again, e.g. ``"model"`` or a fragment's
        name): what the codec lost of this site's contribution is added to the
        next contribution under the same key, so the losses do not accumulate
        over rounds. The direct algorithm only (the ring says once that it is off);
        nothing to do with ``none``.

        ``algorithm``: ``direct`` (full mesh: every site owns a slice; a value is
        encoded twice), ``ring`` (each site talks to its successor only; partial
        sums are re-encoded at every hop, so a value is encoded up to S times), or
        ``auto`` (the one :mod:`isthmus.sim.cost` predicts fastest on ``link_costs``)."""
        # Several rounds may be in flight at once (gradient buckets, overlapped
        # fragments). Chunks of rounds below the oldest one running are
        # stragglers of rounds that are over: nobody waits for them.
        self._active.append(round)
        self._next_floor = max(self._next_floor, round + 1)
        floor = self._floor()
        for key in [k for k in self._incoming if k[0] < floor]:
            del self._incoming[key]
        try:
            return await self._allreduce_round(
                tensor,
                round=round,
                participants=participants,
                weights=weights,
                algorithm=algorithm,
                feedback=feedback,
            )
        finally:
            self._active.remove(round)

    def skip_to(self, round: int) -> None:
        """The next round is ``round`` or later: chunks of earlier rounds are dropped
        (those of rounds still running stay until they end)."""
        self._next_floor = max(self._next_floor, round)
        floor = self._floor()
        for key in [k for k in self._incoming if k[0] < floor]:
            del self._incoming[key]

    def _floor(self) -> int:
        return min(self._active) if self._active else self._next_floor

    async def _allreduce_round(
        self,
        tensor: torch.Tensor,
        *,
        round: int,
        participants: Sequence[str],
        weights: Mapping[str, float],
        algorithm: str = "direct",
        feedback: str | None = None,
    ) -> torch.Tensor:
        """One round of :meth:`allreduce`."""
        if algorithm not in ("direct", "ring", "auto"):
            raise ValueError(f"unknown algorithm {algorithm!r}; use direct, ring or auto")
        if algorithm == "auto":
            if self.link_costs is None:
                raise ValueError("algorithm 'auto' needs link costs: pass link_costs=...")
            algorithm = choose(
                tensor.numel() * 4,
                sorted(participants),
                self.link_costs,
                self.uplink_bytes_per_s,
            )
        self.last_algorithm = algorithm
        me = self.identity.site
        sites = sorted(participants)
        if me not in sites:
            raise ValueError(f"participants {sites} must include this site {me!r}")
        unknown = [s for s in sites if s != me and s not in self.clients]
        if unknown:
            raise ValueError(f"no session with {unknown}; call connect() first")
        bad = [s for s in sites if not (math.isfinite(weights.get(s, -1)) and weights[s] >= 0)]
        if bad:
            raise ValueError(f"every participant needs a finite weight >= 0; missing or bad: {bad}")
        if not any(weights[s] > 0 for s in sites):
            raise ValueError(f"round {round}: no participant has a weight > 0")
        if tensor.dtype != torch.float32:
            raise ValueError(f"expected a float32 tensor, got {tensor.dtype}")
        flat = tensor.detach().reshape(-1).contiguous()
        if not all_finite(flat):
            bad = int((~torch.isfinite(flat)).sum())
            raise RoundError(
                me, f"round {round}: this site's own tensor holds {bad} NaN/Inf values; not sent"
            )
        loop = asyncio.get_running_loop()
        started = loop.time()
        deadline = started + self.deadline_s
        n = len(sites)
        bounds = slice_bounds(flat.numel(), n)
        if algorithm == "ring" and n > 1:
            if feedback is not None and self.codec.name != "none" and not self._warned_ring:
                # The ring re-encodes partial sums at every hop: a site's own loss
                # is not separable from the others'. Say so once, do not fail.
                log.warning("round %d: error feedback is off with the ring algorithm", round)
                self._warned_ring = True
            out = await self._ring(
                flat,
                round=round,
                sites=sites,
                weights=weights,
                bounds=bounds,
                started=started,
                deadline=deadline,
            )
            return out.view_as(tensor)
        mine = sites.index(me)
        a, b = bounds[mine]
        others = [(j, s) for j, s in enumerate(sites) if s != me]
        sent: list[int] = []
        # Error feedback: send this round's values plus what the codec lost last
        # time; a site left out (weight 0) sent nothing that counts, so its
        # residual waits for the next round it counts in.
        lost: torch.Tensor | None = None
        if feedback is not None and self.codec.name != "none" and weights[me] > 0:
            residual = self._residuals.get(feedback)
            if residual is not None and residual.numel() == flat.numel():
                flat = flat + residual
            lost = torch.zeros_like(flat)

        # Reduce-scatter: slice j streams to its owner sites[j], chunk by chunk,
        # while the contributions to this site's slice are decoded as they arrive.
        contributions = {s: self._expect(round, mine, s, b - a) for _, s in others}
        # On every link the contributions go first, the results after: they share
        # one connection, and a result queued ahead of a contribution would hold
        # back the owner who needs that contribution for its own results, leaving
        # its links idle near the end of the round. The link's total bytes are
        # the same in either order.
        handed_over = {s: asyncio.Event() for _, s in others}
        phase1 = [
            asyncio.ensure_future(
                self._send(
                    s,
                    self._encoded_chunks(
                        flat[lo:hi],
                        round=round,
                        shard=j,
                        sent=sent,
                        lost=None if lost is None else lost[lo:hi],
                    ),
                    round,
                    handed_over=handed_over[s],
                )
            )
            for j, s in others
            for lo, hi in [bounds[j]]
        ]
        out = torch.empty_like(flat)
        # Every other slice's result is decoded straight into its place in ``out``
        # as it arrives: no buffer to allocate and copy over at the end of the
        # round, where that work would come after the last byte.
        results = {
            s: self._expect(round, n + j, s, hi - lo, into=out[lo:hi])
            for j, s in others
            for lo, hi in [bounds[j]]
        }
        queues: dict[str, asyncio.Queue[wire_pb2.Chunk | None]] = {
            s: asyncio.Queue() for _, s in others
        }
        phase2 = [
            asyncio.ensure_future(self._send(s, _drain(queues[s], after=handed_over[s]), round))
            for _, s in others
        ]
        phases: dict[str, float] = {}

        async def reduce_and_collect() -> None:
            # Reduce chunk by chunk: as soon as every site's chunk k of this slice is
            # here, chunk k of the result is reduced, encoded once and on its way to
            # every site (and decoded here from the same bytes), while later chunks
            # of the reduce-scatter are still arriving.
            loop_ranges = chunk_ranges(
                b - a, values_per_chunk(self.codec, self.settings.max_chunk_bytes)
            )
            total = sum(weights[s] for s in sites)
            mine_flat = flat[a:b]
            # With an exact codec, decode(encode(x)) is x bit for bit: this site's own
            # values are used as they are (the bytes sent are the same either way).
            exact = self.codec.name == "none"
            own_values = mine_flat if exact else torch.empty(b - a, dtype=torch.float32)
            for index, (lo, hi) in enumerate(loop_ranges):
                if not exact:
                    # This site's own contribution goes through the codec like the others'.
                    own_chunk = await self._encode(
                        mine_flat[lo:hi],
                        round=round,
                        shard=mine,
                        offset=lo,
                        index=index,
                        count=len(loop_ranges),
                    )
                    _own_chunk(own_chunk, self.codec).decode_into(own_values)
                    if lost is not None:
                        lost[a + lo : a + hi] = mine_flat[lo:hi] - own_values[lo:hi]
                for _, s in others:
                    await self._wait_chunk(round, s, contributions[s], index, deadline)
                # A fixed order (sorted sites): the result does not depend on arrival
                # order, and is exact up to float32 rounding in that order.
                parts = {s: contributions[s].buffer[lo:hi] for _, s in others}  # type: ignore[index]
                parts[me] = own_values[lo:hi]
                # Sites of weight 0 (left out of the round by its seal) send zeros
                # and receive the average; their values are not even read.
                counted = [s for s in sites if weights[s] > 0]
                # Reduced in place in ``out``: with an exact codec that is the result;
                # otherwise decoding the encoded result overwrites it below.
                reduced = torch.mul(
                    parts[counted[0]], weights[counted[0]] / total, out=out[a + lo : a + hi]
                )
                for site in counted[1:]:
                    reduced.add_(parts[site], alpha=weights[site] / total)
                result = await self._encode(
                    reduced,
                    round=round,
                    shard=n + mine,
                    offset=lo,
                    index=index,
                    count=len(loop_ranges),
                )
                sent.append(_payload_size(result) * len(others))
                for queue in queues.values():
                    queue.put_nowait(result)
                if not exact:
                    _own_chunk(result, self.codec).decode_into(out[a:b])
            for queue in queues.values():
                queue.put_nowait(None)
            phases["contributions"] = loop.time() - started
            for _, s in others:
                self._incoming.pop((round, mine, s), None)
            for j, s in others:
                await self._wait_for(round, n + j, s, results[s], deadline)
            phases["results"] = loop.time() - started

        try:
            await _unless_a_send_fails(reduce_and_collect(), phase1)
        except BaseException:
            for task in (*phase1, *phase2):
                task.cancel()
            for _, s in others:
                self._incoming.pop((round, mine, s), None)
            raise
        self._outlive(
            round,
            [(s, t) for sends in (phase1, phase2) for (_, s), t in zip(others, sends, strict=True)],
        )
        if lost is not None:
            self._residuals[feedback] = lost  # type: ignore[index]
        # This site's slice from every other site, and every other slice's result.
        received = sum((b - a + hi - lo) * 4 for j, _ in others for lo, hi in [bounds[j]])
        self.last = RoundStats(sum(sent), received, loop.time() - started, phases)
        return out.view_as(tensor)


def _codec_loss(
    chunk: wire_pb2.Chunk, codec: Codec, values: torch.Tensor, lost: torch.Tensor
) -> None:
    """``lost[chunk] = values[chunk] - decode(chunk)``: what encoding lost there."""
    encoded = to_encoded(chunk, chunk.payload)
    span = slice(chunk.offset, chunk.offset + encoded.count)
    torch.sub(values[span], codec.decode(encoded), out=lost[span])


async def _unless_a_send_fails(
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


async def _drain(
    queue: asyncio.Queue[wire_pb2.Chunk | None], *, after: asyncio.Event
) -> AsyncIterator[wire_pb2.Chunk]:
    """The chunks put on ``queue`` until None, once ``after`` is set: one peer's
    all-gather stream, behind its reduce-scatter stream."""
    await after.wait()
    while (chunk := await queue.get()) is not None:
        yield chunk


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


def _own_chunk(chunk: wire_pb2.Chunk, codec: Codec) -> ReceivedChunk:
    """This site's own chunk, taken exactly as a peer would take it."""
    return ReceivedChunk.from_wire(chunk, chunk.payload, codec, "", 0)


def _payload_size(chunk: wire_pb2.Chunk) -> int:
    """Bytes of a chunk's payload. Reading the field copies it, so take the sizes of
    its sections when no lossless stage changed them."""
    if chunk.codec.endswith("+zstd"):
        return len(chunk.payload)
    return chunk.scales_bytes + chunk.values_bytes
