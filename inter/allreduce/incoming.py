"""Incoming buffers: the chunks peers send, kept per (round, shard, site) until a round takes them.

Chunks may arrive before this rank has entered their round (a faster peer):
they wait, encoded, until the round opens the buffer and gives it its size
(:meth:`Incoming.open`); from then on each chunk is decoded straight into it
as it lands, checked for NaN/Inf, and a waiter is woken. The :class:`Inbox`
holds every buffer of one engine and decides which chunks are worth keeping:
those of rounds below the oldest one running are stragglers of rounds that
are over (nobody waits for them), and those too far ahead are refused, so a
peer out of step cannot fill memory.

A buffer lives on the round's device (its staging's): chunks arrive as host
bytes and are decoded there, so a GPU's buffers never pass through the host.
"""

from __future__ import annotations

import asyncio

import torch

from isthmus.inter.allreduce.rounds import Round, RoundError, all_finite
from isthmus.inter.chunks import ChunkError, ReceivedChunk
from isthmus.inter.staging import HOST, Staging
from isthmus.proto import wire_pb2

MAX_ROUNDS_AHEAD = 16
"""How many rounds past its own a rank holds chunks for. Peers are at most a round
or two ahead (every round needs every participant); more is a peer out of step."""

BufferKey = tuple[int, int, str]
"""(round, shard, site)."""


class Incoming:
    """The chunks of one (round, shard, site) arriving into one buffer.

    Chunks may arrive before this rank has entered the round (a faster peer):
    they wait, encoded, until :meth:`open` gives the buffer its size."""

    def __init__(self) -> None:
        self.buffer: torch.Tensor | None = None
        self.pending: list[ReceivedChunk] = []
        self.pending_bytes = 0
        """Encoded bytes of ``pending``: what this buffer holds before its round opens."""
        self.seen: set[int] = set()
        self.received_bytes = 0
        """Payload bytes of the distinct chunks that came (what crossed the WAN for
        this buffer; a chunk sent again counts once, as the sender counts it)."""
        self.count: int | None = None
        self.done = asyncio.Event()
        self.progress = asyncio.Event()
        """Set whenever a chunk lands (waiters clear it before waiting)."""
        self.error: RoundError | None = None
        self.kept: dict[int, ReceivedChunk] = {}
        """With ``keep``: the chunks themselves, to forward them unchanged (ring)."""
        self._keep = False
        self._staging: Staging = HOST

    def open(
        self,
        size: int,
        *,
        keep: bool = False,
        into: torch.Tensor | None = None,
        staging: Staging = HOST,
    ) -> None:
        """Give the chunks a buffer of ``size`` values: ``into`` (where the caller wants
        them, e.g. their place in the round's output: no copy after), or a new one
        on ``staging``'s device, which decodes every chunk there."""
        self._keep = keep
        self._staging = staging
        if into is not None and into.numel() != size:
            raise ValueError(f"buffer of {into.numel()} values for a shard of {size}")
        if into is None:
            into = torch.empty(size, dtype=torch.float32, device=staging.device)
        self.buffer = into
        for chunk in self.pending:
            self._place(chunk)
        self.pending.clear()
        self.pending_bytes = 0

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
        self.received_bytes += len(chunk.encoded.payload)
        if self.buffer is None:
            self.pending.append(chunk)
            self.pending_bytes += len(chunk.encoded.payload)
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
            values = chunk.decode_into(self.buffer, self._staging)
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


class Inbox:
    """Every incoming buffer of one engine, and which rounds' chunks it keeps."""

    def __init__(self, max_early_bytes_per_site: int) -> None:
        self.buffers: dict[BufferKey, Incoming] = {}
        self.bytes_received_from: dict[str, int] = {}
        """Payload bytes of every chunk that came from each site over this engine's
        life (per link): the mirror of the sender's ``bytes_sent_to``, re-sent and
        stale chunks included, as they crossed the WAN too."""
        self.max_early_bytes_per_site = max_early_bytes_per_site
        """(``TransportSettings.max_early_bytes_per_site``) Chunks of a site beyond
        this many bytes held before their rounds open are not taken (ROUND_AHEAD: its
        sender sends them again later): a peer far ahead, or one that floods, cannot
        fill this rank's memory."""
        self._active: list[int] = []
        """Rounds running now (a list: a round may run twice at once only by
        mistake, and then both must finish before it is forgotten)."""
        self._next_floor = 0
        self.stale = 0
        """Chunks dropped because their round was over here: stragglers of a round run
        again, or a replay; counted, never applied."""

    def enter(self, round: int) -> None:
        """``round`` starts. Several rounds may be in flight at once (gradient
        buckets, overlapped fragments); chunks of rounds below the oldest one
        running are stragglers of rounds that are over: nobody waits for them."""
        self._active.append(round)
        self._next_floor = max(self._next_floor, round + 1)
        self._drop_below_floor()

    def leave(self, round: int) -> None:
        self._active.remove(round)

    def skip_to(self, round: int) -> None:
        """The next round is ``round`` or later: chunks of earlier rounds are dropped
        (those of rounds still running stay until they end)."""
        self._next_floor = max(self._next_floor, round)
        self._drop_below_floor()

    def floor(self) -> int:
        """The oldest round whose chunks are still wanted."""
        return min(self._active) if self._active else self._next_floor

    def _drop_below_floor(self) -> None:
        floor = self.floor()
        for key in [k for k in self.buffers if k[0] < floor]:
            del self.buffers[key]

    def receive(self, chunk: ReceivedChunk) -> bool:
        """Take a verified chunk; raise :class:`ChunkError` to refuse one that no
        round can use. False: dropped (its round is over here), not applied."""
        counted = self.bytes_received_from.get(chunk.site, 0)
        self.bytes_received_from[chunk.site] = counted + len(chunk.encoded.payload)
        floor = self.floor()
        if chunk.round < floor:
            # A straggler of a round that is over, or a replay of one: nobody waits for
            # it. Acknowledged all the same: the sender has nothing to send again.
            self.stale += 1
            return False
        if chunk.round > floor + MAX_ROUNDS_AHEAD:
            # Chunks of rounds not yet open are held until they open: bound how far
            # ahead, so a peer out of step (or a bad round number) cannot fill memory.
            raise ChunkError(
                wire_pb2.ROUND_AHEAD,
                f"chunk of round {chunk.round}, but this site is at round {floor}; more "
                f"than {MAX_ROUNDS_AHEAD} rounds ahead; send it again later",
            )
        key = (chunk.round, chunk.shard, chunk.site)
        incoming = self.buffers.get(key)
        if incoming is None or incoming.buffer is None:
            held = self.early_bytes(chunk.site)
            if held + len(chunk.encoded.payload) > self.max_early_bytes_per_site:
                raise ChunkError(
                    wire_pb2.ROUND_AHEAD,
                    f"chunk of round {chunk.round} from site {chunk.site!r}, which already "
                    f"has {held:,} bytes here waiting for rounds not yet open (limit "
                    f"{self.max_early_bytes_per_site:,}); send it again later",
                )
        self.buffers.setdefault(key, Incoming()).add(chunk)
        return True

    def early_bytes(self, site: str) -> int:
        """Encoded bytes of ``site``'s chunks held for rounds not yet open here."""
        return sum(b.pending_bytes for k, b in self.buffers.items() if k[2] == site)

    def expect(
        self,
        round: int,
        shard: int,
        site: str,
        size: int,
        *,
        keep: bool = False,
        into: torch.Tensor | None = None,
        staging: Staging = HOST,
    ) -> Incoming:
        """The buffer for ``site``'s chunks of ``shard``, opened for ``size`` values
        on ``staging``'s device (with those that came early already in place)."""
        incoming = self.buffers.setdefault((round, shard, site), Incoming())
        incoming.open(size, keep=keep, into=into, staging=staging)
        return incoming

    def forget(self, round: int, shard: int, site: str) -> None:
        self.buffers.pop((round, shard, site), None)

    async def wait_for(
        self, round: Round, shard: int, site: str, incoming: Incoming
    ) -> torch.Tensor:
        """Until every chunk of ``incoming`` is in place; then forget it and return
        its buffer. Raises the round's error, or :class:`RoundError` by the deadline."""
        remaining = round.deadline - asyncio.get_running_loop().time()
        try:
            await asyncio.wait_for(incoming.done.wait(), max(0.0, remaining))
        except TimeoutError:
            raise late(round, site, incoming) from None
        finally:
            self.forget(round.number, shard, site)
        if incoming.error is not None:
            raise incoming.error
        assert incoming.buffer is not None
        return incoming.buffer


async def wait_chunk(round: Round, site: str, incoming: Incoming, index: int) -> None:
    """Until chunk ``index`` from ``site`` is in place (or the round fails)."""
    loop = asyncio.get_running_loop()
    while index not in incoming.seen or incoming.buffer is None:
        if incoming.error is not None:
            raise incoming.error
        incoming.progress.clear()
        remaining = round.deadline - loop.time()
        try:
            await asyncio.wait_for(incoming.progress.wait(), max(0.0, remaining))
        except TimeoutError:
            raise late(round, site, incoming) from None
    if incoming.error is not None:
        raise incoming.error


def late(round: Round, site: str, incoming: Incoming) -> RoundError:
    """The error of a peer that did not deliver by the deadline. How far it got
    tells a dead peer (nothing) from a stuck chunk (all but one)."""
    of = "?" if incoming.count is None else incoming.count
    return RoundError(
        site,
        f"round {round.number}: site {site!r} ({round.addresses.get(site)}) did not deliver "
        f"within {round.deadline_s:g} s ({len(incoming.seen)} of {of} chunks came); it is "
        "down, partitioned or slow",
    )
