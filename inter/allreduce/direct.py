"""The direct all-reduce: every site owns a slice, and talks to every other site.

In the reduce-scatter phase each site sends slice j of its tensor to the owner
of j; the owner reduces the contributions in a fixed order (sorted site names)
and encodes the result *once*; in the all-gather phase it sends those same
bytes to every site and decodes them itself too. Every site therefore ends
with bitwise-identical output, whatever the codec. The sparse codec (``topk``)
encodes the result at the density of the union of the sites' positions (its
density times the sites counted: :meth:`Codec.for_sum_of`), so every site
downloads up to that many times the bytes it uploads, as an all-gather of the
sparse contributions would. A value is encoded twice
on its way (once as a contribution, once as the owner's result), so the
end-to-end error is at most two of the codec's bounds (see
``Codec.max_error``): the contributions' weighted bounds E, plus the bound of
the second encode, taken for values of magnitude up to |exact average| + E (a
blockwise codec's step follows the block absmax of what the owner reduced,
which the first encode can raise).

Both phases are pipelined by chunks: as soon as every site's chunk k of this
site's slice is in, chunk k of the result is reduced, encoded and on its way,
while later chunks of the reduce-scatter still arrive. Wire tags:
reduce-scatter chunks carry ``shard = j``, all-gather chunks ``shard = S + j``
(both plus ``round.shard_base``).

Every buffer (contributions, results, the own slice through the codec, the
error-feedback loss) lives on the values' device, ``round.staging.device``:
a GPU's values are reduced on the GPU and only encoded bytes leave it.
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


async def direct_allreduce(
    round: Round,
    flat: torch.Tensor,
    *,
    inbox: Inbox,
    outgoing: Outgoing,
    feedback: ErrorFeedback,
    key: str | None,
    gather: bool = True,
) -> tuple[torch.Tensor, RoundStats]:
    """The weighted average of ``flat`` over ``round.sites``, and what it moved.
    ``key``: the vector's name for error feedback (None: none). ``gather=False``:
    the reduce-scatter alone: only this site's slice of the output holds the
    average, reduced from the decoded contributions and not encoded again (the
    two-level algorithm takes it on from there)."""
    return await DirectRound(round, flat, inbox, outgoing, feedback, key, gather).run()


class DirectRound:
    """One round of the direct algorithm at this site, in named steps."""

    def __init__(
        self,
        round: Round,
        flat: torch.Tensor,
        inbox: Inbox,
        outgoing: Outgoing,
        feedback: ErrorFeedback,
        key: str | None,
        gather: bool = True,
    ) -> None:
        self.round = round
        self.gather = gather
        self.inbox = inbox
        self.outgoing = outgoing
        self.feedback = feedback
        self.key = key
        me, sites = round.me, round.sites
        self.n = len(sites)
        self.mine = sites.index(me)
        self.base = round.shard_base
        self.a, self.b = round.bounds[self.mine]
        self.others = [(j, s) for j, s in enumerate(sites) if s != me]
        # Error feedback: send this round's values plus what the codec lost last
        # time; a site left out (weight 0) sent nothing that counts, so its
        # residual waits for the next round it counts in.
        self.flat, self.lost = feedback.begin(key, flat, round.codec, counted=round.weights[me] > 0)
        self.sent: list[int] = []
        self.phases: dict[str, float] = {}
        self.out = torch.empty_like(flat)
        # On every link the contributions go first, the results after: they share
        # one connection, and a result queued ahead of a contribution would hold
        # back the owner who needs that contribution for its own results, leaving
        # its links idle near the end of the round. The link's total bytes are
        # the same in either order.
        self.handed_over = {s: asyncio.Event() for _, s in self.others}
        self.queues: dict[str, asyncio.Queue[wire_pb2.Chunk | None]] = {
            s: asyncio.Queue() for _, s in self.others
        }
        # Sites of weight 0 (left out of the round by its seal) send zeros and
        # receive the average; their values are not even read.
        self.counted = [s for s in sites if round.weights[s] > 0]
        self.total = round.total_weight
        self.contributions: dict[str, Incoming] = {}
        self.results: dict[str, Incoming] = {}
        self.contribution_sends: list[asyncio.Future[None]] = []
        self.result_sends: list[asyncio.Future[None]] = []

    async def run(self) -> tuple[torch.Tensor, RoundStats]:
        """Open the buffers and start every stream, then reduce this site's slice
        and collect the others' results; a send that fails first fails the round.
        The round is over here once the result is in: its last sends outlive it."""
        loop = asyncio.get_running_loop()
        self.expect_contributions()
        self.send_contributions()
        if self.gather:
            self.expect_results()
            self.send_results()
        try:
            await unless_a_send_fails(self.reduce_and_collect(), self.contribution_sends)
        except BaseException:
            for task in (*self.contribution_sends, *self.result_sends):
                task.cancel()
            self.forget_contributions()
            raise
        sends = (
            (self.contribution_sends, self.result_sends)
            if self.gather
            else (self.contribution_sends,)
        )
        self.outgoing.outlive(
            self.round.number,
            [(s, t) for tasks in sends for (_, s), t in zip(self.others, tasks, strict=True)],
        )
        if self.lost is not None:
            self.feedback.keep(self.key, self.lost)  # type: ignore[arg-type]
        # This site's slice from every other site, and every other slice's result:
        # the bytes that came over the WAN, as their senders counted them.
        received = sum(
            c.received_bytes for c in (*self.contributions.values(), *self.results.values())
        )
        stats = RoundStats(sum(self.sent), received, loop.time() - self.round.started, self.phases)
        return self.out, stats

    def bounds(self, j: int) -> tuple[int, int]:
        return self.round.bounds[j]

    def expect_contributions(self) -> None:
        """The other sites' shares of this site's slice, decoded as they arrive."""
        size = self.b - self.a
        r = self.round
        self.contributions = {
            s: self.inbox.expect(r.number, self.base + self.mine, s, size, staging=r.staging)
            for _, s in self.others
        }

    def send_contributions(self) -> None:
        """Reduce-scatter: slice j streams to its owner sites[j], chunk by chunk."""
        r = self.round
        for j, s in self.others:
            lo, hi = self.bounds(j)
            chunks = self.outgoing.encoded_chunks(
                r.codec,
                r.max_chunk_bytes,
                self.flat[lo:hi],
                round=r.number,
                shard=self.base + j,
                sent=self.sent,
                lost=None if self.lost is None else self.lost[lo:hi],
                staging=r.staging,
            )
            send = self.outgoing.send(
                s, chunks, round=r.number, deadline_s=r.deadline_s, handed_over=self.handed_over[s]
            )
            self.contribution_sends.append(asyncio.ensure_future(send))

    def expect_results(self) -> None:
        """Every other slice's result is decoded straight into its place in ``out``
        as it arrives: no buffer to allocate and copy over at the end of the round,
        where that work would come after the last byte."""
        r = self.round
        for j, s in self.others:
            lo, hi = self.bounds(j)
            shard = self.base + self.n + j
            self.results[s] = self.inbox.expect(
                self.round.number, shard, s, hi - lo, into=self.out[lo:hi], staging=r.staging
            )

    def send_results(self) -> None:
        """All-gather: each peer's stream of this slice's results, behind its
        contributions (see ``handed_over``); fed chunk by chunk as they are reduced."""
        r = self.round
        for _, s in self.others:
            chunks = drain(self.queues[s], after=self.handed_over[s])
            send = self.outgoing.send(s, chunks, round=r.number, deadline_s=r.deadline_s)
            self.result_sends.append(asyncio.ensure_future(send))

    async def reduce_and_collect(self) -> None:
        """Reduce chunk by chunk: as soon as every site's chunk k of this slice is
        here, chunk k of the result is reduced, encoded once and on its way to every
        site (and decoded here from the same bytes), while later chunks of the
        reduce-scatter are still arriving. Then wait for every other slice's result."""
        r = self.round
        loop = asyncio.get_running_loop()
        size = self.b - self.a
        ranges = chunk_ranges(size, values_per_chunk(r.codec, r.max_chunk_bytes))
        mine_flat = self.flat[self.a : self.b]
        # With an exact codec, decode(encode(x)) is x bit for bit: this site's own
        # values are used as they are (the bytes sent are the same either way).
        exact = r.codec.name == "none"
        own_values = mine_flat if exact else torch.empty_like(mine_flat)
        # topk: the result carries the union of the positions the sites sent.
        result_codec = r.codec.for_sum_of(len(self.counted))
        for index, (lo, hi) in enumerate(ranges):
            if not exact:
                await self.pass_own_through_codec(mine_flat, own_values, lo, hi, index, len(ranges))
            for _, s in self.others:
                await wait_chunk(r, s, self.contributions[s], index)
            reduced = self.reduce(own_values, lo, hi)
            if not self.gather:
                continue  # the reduced values stay, exact, in out
            result = await self.outgoing.encode(
                result_codec, reduced, round=r.number, shard=self.base + self.n + self.mine,
                offset=lo,
                index=index, count=len(ranges), staging=r.staging,
            )  # fmt: skip
            self.share(result)
            if not exact:
                own_chunk(result, result_codec).decode_into(self.out[self.a : self.b], r.staging)
        for queue in self.queues.values():
            queue.put_nowait(None)
        self.phases["contributions"] = loop.time() - r.started
        self.forget_contributions()
        if not self.gather:
            return
        for j, s in self.others:
            await self.inbox.wait_for(r, self.base + self.n + j, s, self.results[s])
        self.phases["results"] = loop.time() - r.started

    async def pass_own_through_codec(
        self,
        mine_flat: torch.Tensor,
        own_values: torch.Tensor,
        lo: int,
        hi: int,
        index: int,
        count: int,
    ) -> None:
        """This site's own contribution goes through the codec like the others':
        decoded into ``own_values``, its loss kept for error feedback."""
        r = self.round
        chunk = await self.outgoing.encode(
            r.codec, mine_flat[lo:hi], round=r.number, shard=self.base + self.mine, offset=lo,
            index=index, count=count, staging=r.staging,
        )  # fmt: skip
        own_chunk(chunk, r.codec).decode_into(own_values, r.staging)
        if self.lost is not None:
            self.lost[self.a + lo : self.a + hi] = mine_flat[lo:hi] - own_values[lo:hi]

    def reduce(self, own_values: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        """Chunk [lo, hi) of this slice's weighted average, in place in ``out``: with
        an exact codec that is the result; otherwise decoding the encoded result
        overwrites it. A fixed order (sorted sites): the result does not depend on
        arrival order, and is exact up to float32 rounding in that order."""
        r = self.round
        parts = {s: self.contributions[s].buffer[lo:hi] for _, s in self.others}  # type: ignore[index]
        parts[r.me] = own_values[lo:hi]
        counted, total = self.counted, self.total
        out = self.out[self.a + lo : self.a + hi]
        reduced = torch.mul(parts[counted[0]], r.weights[counted[0]] / total, out=out)
        for site in counted[1:]:
            reduced.add_(parts[site], alpha=r.weights[site] / total)
        return reduced

    def share(self, result: wire_pb2.Chunk) -> None:
        """Queue a result chunk for every other site (the same bytes for each)."""
        self.sent.append(payload_size(result) * len(self.others))
        for queue in self.queues.values():
            queue.put_nowait(result)

    def forget_contributions(self) -> None:
        for _, s in self.others:
            self.inbox.forget(self.round.number, self.base + self.mine, s)
