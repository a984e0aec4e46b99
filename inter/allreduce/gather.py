"""The gather all-reduce: every site sends its whole contribution to every other site.

Each site encodes its values once and streams the same bytes to every other
site; each site decodes every contribution (its own from its own bytes) and
reduces them itself, in a fixed order (sorted site names). The round costs one
one-way trip of the longest link instead of the direct algorithm's two (a
reduce-scatter to slice owners, then their results back), for (S - 1) times
the vector on every site's uplink where direct sends 2 (S - 1) / S of it. On
long links with small payloads (the DiLoCo family's compressed
pseudo-gradients, a round's seal) that halves the time a round waits; on
large payloads direct moves fewer bytes, and the cost model
(:func:`isthmus.sim.cost.gather_seconds`) says which is faster.

Each site then encodes the average with the codec of a result
(:meth:`Codec.for_sum_of`) and decodes it, as an owner of the direct algorithm
does with its slice: the result is the direct algorithm's, bit for bit where
the reduction rounds alike, and a value is encoded twice (the bound of
``Codec.max_error`` twice, as with direct). That second encode is not a cost
here but part of the aggregate: the DiLoCo family's ternary pseudo-gradients,
averaged exactly, ended three-continents' DiLoCo at a held-out loss of 2.409
against 2.175 with the average encoded again (2026-12-02, docs/benchmarks.md):
re-quantising the mean of ternary values keeps where the sites agree.

Every site ends with the same bits: each reduces the same decoded values in
the same order with the same arithmetic, and the codec encodes the same input
to the same bytes on every device. The weighted sum is a multiply and then an
add (two correctly rounded operations), never an ``add`` with ``alpha``, which
a CPU or GPU kernel may fuse into one rounding on one device and not on
another.

A site of weight 0 (left out of the round by its seal) sends nothing: nobody
would read it. It still receives every counted contribution and reduces them
like the others.
"""

from __future__ import annotations

import asyncio

import torch

from isthmus.inter.allreduce.feedback import ErrorFeedback
from isthmus.inter.allreduce.incoming import Inbox, Incoming, wait_chunk
from isthmus.inter.allreduce.rounds import Round, RoundStats, own_chunk, payload_size
from isthmus.inter.allreduce.sending import Outgoing, drain, unless_a_send_fails
from isthmus.inter.chunks import chunk_ranges, values_per_chunk
from isthmus.proto import wire_pb2


async def gather_allreduce(
    round: Round,
    flat: torch.Tensor,
    *,
    inbox: Inbox,
    outgoing: Outgoing,
    feedback: ErrorFeedback,
    key: str | None,
) -> tuple[torch.Tensor, RoundStats]:
    """The weighted average of ``flat`` over ``round.sites``, and what it moved.
    ``key``: the vector's name for error feedback (None: none)."""
    return await GatherRound(round, flat, inbox, outgoing, feedback, key).run()


class GatherRound:
    """One round of the gather algorithm at this site, in named steps."""

    def __init__(
        self,
        round: Round,
        flat: torch.Tensor,
        inbox: Inbox,
        outgoing: Outgoing,
        feedback: ErrorFeedback,
        key: str | None,
    ) -> None:
        self.round = round
        self.inbox = inbox
        self.outgoing = outgoing
        self.feedback = feedback
        self.key = key
        me = round.me
        self.counted = [s for s in round.sites if round.weights[s] > 0]
        self.sending = round.weights[me] > 0
        self.senders = [s for s in self.counted if s != me]
        self.receivers = [s for s in round.sites if s != me]
        self.flat, self.lost = feedback.begin(key, flat, round.codec, counted=self.sending)
        # Chunks as the direct algorithm cuts them (each site's slice from its start):
        # a blockwise codec's blocks, and so the values, are direct's.
        per_chunk = values_per_chunk(round.codec, round.max_chunk_bytes)
        cut = [
            (a + lo, a + hi) for a, b in round.bounds for lo, hi in chunk_ranges(b - a, per_chunk)
        ]
        # No empty chunks for the empty slices of a short vector (one chunk if empty).
        self.ranges = [r for r in cut if r[1] > r[0]] or [(0, 0)]
        # With an exact codec, decode(encode(x)) is x bit for bit: this site's own
        # values are used as they are (the bytes sent are the same either way).
        self.exact = round.codec.name == "none"
        self.own = self.flat if self.exact or not self.sending else torch.empty_like(self.flat)
        self.own_ready = [asyncio.Event() for _ in self.ranges]
        self.result_codec = round.codec.for_sum_of(len(self.counted))
        self.out = torch.empty_like(flat)
        self.queues: dict[str, asyncio.Queue[wire_pb2.Chunk | None]] = {
            s: asyncio.Queue() for s in self.receivers
        }
        self.contributions: dict[str, Incoming] = {}
        self.sends: list[asyncio.Future[None]] = []
        self.encoding: asyncio.Future[None] | None = None
        self.sent: list[int] = []
        self.phases: dict[str, float] = {}

    async def run(self) -> tuple[torch.Tensor, RoundStats]:
        """Open the buffers, start the streams and this site's encoding, reduce as the
        chunks come; a send that fails first fails the round. The round is over here
        once the average is in place: its last sends outlive it."""
        loop = asyncio.get_running_loop()
        r = self.round
        self.contributions = {
            s: self.inbox.expect(r.number, r.shard_base, s, self.flat.numel(), staging=r.staging)
            for s in self.senders
        }
        if self.sending:
            for s in self.receivers:
                send = self.outgoing.send(
                    s, drain(self.queues[s]), round=r.number, deadline_s=r.deadline_s
                )
                self.sends.append(asyncio.ensure_future(send))
            self.encoding = asyncio.ensure_future(self.encode_and_share())
        watched = [*self.sends, self.encoding] if self.encoding is not None else []
        try:
            await unless_a_send_fails(self.reduce(), watched)
        except BaseException:
            for task in watched:
                task.cancel()
            self.forget_contributions()
            raise
        if self.sending:
            self.outgoing.outlive(r.number, list(zip(self.receivers, self.sends, strict=True)))
        if self.lost is not None:
            self.feedback.keep(self.key, self.lost)  # type: ignore[arg-type]
        received = sum(c.received_bytes for c in self.contributions.values())
        stats = RoundStats(sum(self.sent), received, loop.time() - r.started, self.phases)
        return self.out, stats

    async def encode_and_share(self) -> None:
        """Encode this site's values once, chunk by chunk, and queue each chunk for
        every other site (the same bytes for each); decode it here too, so that this
        site reduces what the others receive, and keep what it lost for feedback."""
        r = self.round
        for index, (lo, hi) in enumerate(self.ranges):
            chunk = await self.outgoing.encode(
                r.codec, self.flat[lo:hi], round=r.number, shard=r.shard_base, offset=lo,
                index=index, count=len(self.ranges), staging=r.staging,
            )  # fmt: skip
            for queue in self.queues.values():
                queue.put_nowait(chunk)
            self.sent.append(payload_size(chunk) * len(self.receivers))
            if not self.exact:
                own_chunk(chunk, r.codec).decode_into(self.own, r.staging)
                if self.lost is not None:
                    torch.sub(self.flat[lo:hi], self.own[lo:hi], out=self.lost[lo:hi])
            self.own_ready[index].set()
        for queue in self.queues.values():
            queue.put_nowait(None)

    async def reduce(self) -> None:
        """Chunk by chunk, as soon as every counted site's chunk k is here (this site's
        own decoded too): chunk k of the weighted average, in sorted site order."""
        r = self.round
        loop = asyncio.get_running_loop()
        for index, (lo, hi) in enumerate(self.ranges):
            if self.sending:
                await self.own_ready[index].wait()
            for s in self.senders:
                await wait_chunk(r, s, self.contributions[s], index)
            reduced = self.reduce_chunk(lo, hi)
            if not self.exact:
                # The average through the codec, as an owner of the direct algorithm
                # encodes it: every site encodes the same bits the same way.
                result = await self.outgoing.encode(
                    self.result_codec, reduced, round=r.number, shard=r.shard_base,
                    offset=lo, index=index, count=len(self.ranges), staging=r.staging,
                )  # fmt: skip
                own_chunk(result, self.result_codec).decode_into(self.out, r.staging)
        self.phases["contributions"] = loop.time() - r.started
        self.forget_contributions()

    def reduce_chunk(self, lo: int, hi: int) -> torch.Tensor:
        r = self.round
        total = r.total_weight
        out = self.out[lo:hi]
        scratch = torch.empty_like(out) if len(self.counted) > 1 else out
        for k, site in enumerate(self.counted):
            own = site == r.me
            part = self.own[lo:hi] if own else self.contributions[site].buffer[lo:hi]  # type: ignore[index]
            # A multiply, then an add: each rounded once, the same on every device.
            torch.mul(part, r.weights[site] / total, out=out if k == 0 else scratch)
            if k:
                out.add_(scratch)
        return out

    def forget_contributions(self) -> None:
        for s in self.senders:
            self.inbox.forget(self.round.number, self.round.shard_base, s)
