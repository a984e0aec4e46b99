"""The ring all-reduce: each site talks to its successor only, pipelined by chunks.

Site i sends only to its successor and hears only from its predecessor, so it
uses one link at a time: the better choice where each site's uplink, not each
pair's link, is the bottleneck (see :mod:`isthmus.sim.cost`).

Reduce-scatter, step t = 0 .. S-2: send segment (i - t) mod S, the sum so far
of this site's share and what came from the predecessor at step t - 1.
After it, site i holds segment (i + 1) mod S complete; it encodes that once.
All-gather, step t: send segment (i + 1 - t) mod S; from step 1 on these are
the predecessor's chunks forwarded unchanged, so every site decodes the same
bytes. Chunk k of a step leaves as soon as chunk k of the previous step is in.

Partial sums are re-encoded at every hop, so a value is encoded up to S times
(the direct algorithm: twice), and error feedback is off: a site's own loss
is not separable from the others'.

Buffers live on the values' device (``round.staging.device``), as in the
direct algorithm; forwarded chunks stay host bytes and are never decoded twice.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import torch

from isthmus.inter.allreduce.incoming import Inbox, wait_chunk
from isthmus.inter.allreduce.rounds import Round, RoundStats, own_chunk, payload_size
from isthmus.inter.allreduce.sending import Outgoing, unless_a_send_fails
from isthmus.inter.chunks import chunk_ranges, to_wire, values_per_chunk
from isthmus.proto import wire_pb2


async def ring_allreduce(
    round: Round, flat: torch.Tensor, *, inbox: Inbox, outgoing: Outgoing
) -> tuple[torch.Tensor, RoundStats]:
    """The weighted average of ``flat`` over ``round.sites`` (two or more), and
    what it moved."""
    return await RingRound(round, flat, inbox, outgoing).run()


class RingRound:
    """One round of the ring at this site, in named steps."""

    def __init__(self, round: Round, flat: torch.Tensor, inbox: Inbox, outgoing: Outgoing) -> None:
        self.round = round
        self.inbox = inbox
        self.outgoing = outgoing
        sites = round.sites
        n = self.n = len(sites)
        i = self.i = sites.index(round.me)
        self.succ, self.pred = sites[(i + 1) % n], sites[(i - 1) % n]
        # A scaled copy: the ring sums shares.
        self.local = flat * (round.weights[round.me] / round.total_weight)
        self.per_chunk = values_per_chunk(round.codec, round.max_chunk_bytes)
        number, pred = round.number, self.pred
        # Step t of the reduce-scatter brings segment (i - t - 1), of the all-gather
        # segment (i - t), both from the predecessor; the all-gather's chunks are
        # kept whole, to be forwarded unchanged.
        staging = round.staging
        self.rs_in = {
            t: inbox.expect(number, (i - t - 1) % n, pred, self.size(i - t - 1), staging=staging)
            for t in range(n - 1)
        }
        self.ag_in = {
            t: inbox.expect(
                number, n + (i - t) % n, pred, self.size(i - t), keep=True, staging=staging
            )
            for t in range(n - 1)
        }
        self.out = torch.empty_like(flat)
        self.sent: list[int] = []
        self.owned_segment = (i + 1) % n
        self.owned: list[wire_pb2.Chunk] = []
        """This site's segment, reduced and encoded, chunk by chunk as it is ready."""
        self.owned_ready = asyncio.Event()

    def seg(self, k: int) -> tuple[int, int]:
        return self.round.bounds[k % self.n]

    def size(self, k: int) -> int:
        lo, hi = self.seg(k)
        return hi - lo

    def ranges(self, k: int) -> list[tuple[int, int]]:
        return chunk_ranges(self.size(k), self.per_chunk)

    async def run(self) -> tuple[torch.Tensor, RoundStats]:
        """Both phases' streams to the successor and the reduction of this site's
        segment run at once; the round is over here once every segment is in."""
        r, succ = self.round, self.succ
        tasks = [
            asyncio.ensure_future(
                self.outgoing.send(
                    succ, self.reduce_scatter(), round=r.number, deadline_s=r.deadline_s
                )
            ),
            asyncio.ensure_future(self.reduce_owned()),
            asyncio.ensure_future(
                self.outgoing.send(succ, self.all_gather(), round=r.number, deadline_s=r.deadline_s)
            ),
        ]
        try:
            # Every segment travels the whole ring: a send that fails dooms the round.
            await unless_a_send_fails(self.collect(owned=tasks[1]), [tasks[0], tasks[2]])
            self.forget_reduce_scatter()
        except BaseException:
            for task in tasks:
                task.cancel()
            self.forget_reduce_scatter()
            raise
        self.outgoing.outlive(r.number, [(succ, tasks[0]), (succ, tasks[2])])
        # Every step brought one segment from the predecessor, in each phase.
        received = sum(c.received_bytes for c in (*self.rs_in.values(), *self.ag_in.values()))
        seconds = asyncio.get_running_loop().time() - r.started
        return self.out, RoundStats(sum(self.sent), received, seconds)

    async def reduce_scatter(self) -> AsyncIterator[wire_pb2.Chunk]:
        """The chunks to the successor, step by step: this site's share of a segment
        plus what the predecessor sent of it at the step before."""
        r, i, n = self.round, self.i, self.n
        for t in range(n - 1):
            segment = (i - t) % n
            lo, _ = self.seg(segment)
            spans = self.ranges(segment)
            for index, (c_lo, c_hi) in enumerate(spans):
                part = self.local[lo + c_lo : lo + c_hi]
                if t > 0:
                    incoming = self.rs_in[t - 1]
                    await wait_chunk(r, self.pred, incoming, index)
                    part = incoming.buffer[c_lo:c_hi] + part  # type: ignore[index]
                chunk = await self.outgoing.encode(
                    r.codec, part, round=r.number, shard=segment, offset=c_lo,
                    index=index, count=len(spans), staging=r.staging,
                )  # fmt: skip
                self.sent.append(payload_size(chunk))
                yield chunk

    async def reduce_owned(self) -> None:
        """The last reduce-scatter step brings segment (i + 1) % n: add this site's
        share, encode the result once, decode it into ``out`` from those bytes."""
        r = self.round
        incoming = self.rs_in[self.n - 2]
        lo, hi = self.seg(self.owned_segment)
        spans = self.ranges(self.owned_segment)
        for index, (c_lo, c_hi) in enumerate(spans):
            await wait_chunk(r, self.pred, incoming, index)
            part = incoming.buffer[c_lo:c_hi] + self.local[lo + c_lo : lo + c_hi]  # type: ignore[index]
            chunk = await self.outgoing.encode(
                r.codec, part, round=r.number, shard=self.n + self.owned_segment, offset=c_lo,
                index=index, count=len(spans), staging=r.staging,
            )  # fmt: skip
            own_chunk(chunk, r.codec).decode_into(self.out[lo:hi], r.staging)
            self.owned.append(chunk)
            self.owned_ready.set()

    async def all_gather(self) -> AsyncIterator[wire_pb2.Chunk]:
        """The chunks to the successor: this site's reduced segment as it is ready,
        then the predecessor's all-gather chunks, forwarded unchanged."""
        r, i, n = self.round, self.i, self.n
        for index in range(len(self.ranges(self.owned_segment))):
            while len(self.owned) <= index:
                self.owned_ready.clear()
                await self.owned_ready.wait()
            self.sent.append(payload_size(self.owned[index]))
            yield self.owned[index]
        for t in range(1, n - 1):
            segment = (i + 1 - t) % n
            incoming = self.ag_in[t - 1]
            for index in range(len(self.ranges(segment))):
                await wait_chunk(r, self.pred, incoming, index)
                chunk = to_wire(incoming.kept[index])
                self.sent.append(payload_size(chunk))
                yield chunk

    async def collect(self, *, owned: asyncio.Future[None]) -> None:
        """Every other segment's result into ``out``; then this site's own, reduced
        and decoded into ``out`` by ``owned``."""
        r, i, n = self.round, self.i, self.n
        for t in range(n - 1):
            segment = (i - t) % n
            lo, hi = self.seg(segment)
            self.out[lo:hi] = await self.inbox.wait_for(r, n + segment, self.pred, self.ag_in[t])
        await owned

    def forget_reduce_scatter(self) -> None:
        for t in range(self.n - 1):
            self.inbox.forget(self.round.number, (self.i - t - 1) % self.n, self.pred)
