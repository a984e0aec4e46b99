"""The two-level all-reduce: inside each region, across regions between counterparts, inside again.

Sites of one region (the job's ``regions:``) share fast links and one long-haul
capacity. The flat direct algorithm sends every site's share to every other
site, so a region of m of the S sites pushes ``m (S - m) N / S`` bytes through
its long-haul in each phase. In two levels a region pushes ``(K - 1) N / K``
(K regions), and every member carries its part of it:

1. **Reduce-scatter inside the region** (the direct algorithm's first phase,
   over the fast links): member k of a region of m ends with slice k of the
   region's weighted average, reduced exactly from the decoded contributions.
2. **Across regions**: the tensor is cut at every region's slice boundaries;
   each piece lies in one slice of every region, so it has one holder in each
   (its counterparts), and they average it by the direct algorithm, each
   region weighted by its total weight. The average of region averages so
   weighted is the global weighted average, and every counterpart ends with
   the piece's same bytes (its owners encode once).
3. **All-gather inside the region**: each member sends its slice's result to
   the others as float32, exact, over the fast links. So every site of every
   region ends with the same bytes.

Inside a region each site sends ``2 (m - 1) N / m``, as the flat algorithm
would among m sites. A value is encoded three times on its way (its
contribution inside, its region's share across, the owner's result across);
phase 3 adds no error. Error feedback: phase 1 under the caller's key (what
this site's own contribution lost), phase 2 under ``key/across/p`` (what its
region's share of piece p lost). Wire shards: phase 1 uses ``[0, 2S)``, piece
p of phase 2 ``[2S (1 + p), 2S (2 + p))``, and phase 3 ``2S (1 + P)`` (P
pieces), so no chunk lands in another phase's buffers.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
from collections.abc import Mapping

import torch

from isthmus.inter.allreduce.direct import direct_allreduce
from isthmus.inter.allreduce.feedback import ErrorFeedback
from isthmus.inter.allreduce.incoming import Inbox, Incoming
from isthmus.inter.allreduce.rounds import EXACT, Round, RoundStats, slice_bounds
from isthmus.inter.allreduce.sending import Outgoing, unless_a_send_fails


def region_groups(sites: list[str], region_of: Mapping[str, str]) -> dict[str, list[str]]:
    """The participants of each region, sorted, regions in sorted order. A site with
    no region is a region of its own (named after it)."""
    groups: dict[str, list[str]] = {}
    for site in sorted(sites):
        groups.setdefault(region_of.get(site, f"site:{site}"), []).append(site)
    return dict(sorted(groups.items()))


async def two_level_allreduce(
    round: Round,
    flat: torch.Tensor,
    *,
    region_of: Mapping[str, str],
    inbox: Inbox,
    outgoing: Outgoing,
    feedback: ErrorFeedback,
    key: str | None,
) -> tuple[torch.Tensor, RoundStats]:
    """The weighted average of ``flat`` over ``round.sites``, in two levels over the
    regions of ``region_of``, and what it moved from this site."""
    return await TwoLevelRound(round, flat, region_of, inbox, outgoing, feedback, key).run()


class TwoLevelRound:
    """One round of the two-level algorithm at this site, in named phases."""

    def __init__(
        self,
        round: Round,
        flat: torch.Tensor,
        region_of: Mapping[str, str],
        inbox: Inbox,
        outgoing: Outgoing,
        feedback: ErrorFeedback,
        key: str | None,
    ) -> None:
        self.round = round
        self.flat = flat
        self.inbox = inbox
        self.outgoing = outgoing
        self.feedback = feedback
        self.key = key
        self.groups = region_groups(round.sites, region_of)
        self.region = next(r for r, members in self.groups.items() if round.me in members)
        self.members = self.groups[self.region]
        self.weight_of = {
            r: sum(round.weights[s] for s in members) for r, members in self.groups.items()
        }
        n = flat.numel()
        self.slices = {r: slice_bounds(n, len(m)) for r, m in self.groups.items()}
        """Each region's phase-1 slices, one per member in sorted order."""
        self.a, self.b = self.slices[self.region][self.members.index(round.me)]
        self.pieces = _refinement(list(self.slices.values()), n)
        stride = 2 * len(round.sites)
        self.gather_shard = stride * (1 + len(self.pieces))
        self.out = torch.empty_like(flat)
        self.sent: list[int] = []
        self.received = 0
        self.phases: dict[str, float] = {}

    def holder(self, region: str, lo: int) -> str:
        """The member of ``region`` whose phase-1 slice holds value ``lo``."""
        for member, (a, b) in zip(self.groups[region], self.slices[region], strict=True):
            if a <= lo < b:
                return member
        raise AssertionError(f"value {lo} in no slice of region {region}")

    async def run(self) -> tuple[torch.Tensor, RoundStats]:
        loop = asyncio.get_running_loop()
        r = self.round
        # Phase 3's buffers first: a member quicker across regions may send early.
        results = self.expect_results()
        try:
            await self.reduce_scatter()
            self.phases["inside"] = loop.time() - r.started
            mine = [p for p, (lo, hi) in enumerate(self.pieces) if self.a <= lo < self.b]
            await asyncio.gather(*(self.across(p) for p in mine))
            self.phases["across"] = loop.time() - r.started
            await self.all_gather(results)
        except BaseException:
            for site, _ in results:
                self.inbox.forget(r.number, self.gather_shard, site)
            raise
        self.phases["results"] = loop.time() - r.started
        stats = RoundStats(sum(self.sent), self.received, loop.time() - r.started, self.phases)
        return self.out, stats

    async def reduce_scatter(self) -> None:
        """Phase 1: this site's slice of the region's weighted average, into ``out``."""
        r = self.round
        a, b = self.a, self.b
        if len(self.members) == 1:
            self.out.copy_(self.flat)
            return
        if self.weight_of[self.region] == 0:
            # Nobody here counts this round: the region takes part with weight 0.
            self.out[a:b] = 0
            return
        plan = dataclasses.replace(r, sites=self.members, bounds=self.slices[self.region])
        reduced, stats = await direct_allreduce(
            plan, self.flat, inbox=self.inbox, outgoing=self.outgoing,
            feedback=self.feedback, key=self.key, gather=False,
        )  # fmt: skip
        self.out[a:b] = reduced[a:b]
        self.count(stats)

    async def across(self, p: int) -> None:
        """Phase 2 for piece ``p``: the direct algorithm among its holders, one per
        region, each region weighted by its total; the result replaces it in ``out``."""
        r = self.round
        lo, hi = self.pieces[p]
        holders = {region: self.holder(region, lo) for region in self.groups}
        sites = sorted(holders.values())
        if len(sites) == 1:
            return
        weights = {s: self.weight_of[region] for region, s in holders.items()}
        plan = dataclasses.replace(
            r,
            sites=sites,
            weights=weights,
            bounds=slice_bounds(hi - lo, len(sites)),
            shard_base=2 * len(r.sites) * (1 + p),
        )
        key = None if self.key is None else f"{self.key}/across/{p}"
        result, stats = await direct_allreduce(
            plan, self.out[lo:hi].clone(), inbox=self.inbox, outgoing=self.outgoing,
            feedback=self.feedback, key=key,
        )  # fmt: skip
        self.out[lo:hi] = result
        self.count(stats)

    def expect_results(self) -> list[tuple[str, Incoming]]:
        """Phase 3's buffers: each other member's slice, decoded straight into its
        place in ``out``."""
        r = self.round
        expected = []
        for site, (a, b) in zip(self.members, self.slices[self.region], strict=True):
            if site != r.me:
                incoming = self.inbox.expect(
                    r.number, self.gather_shard, site, b - a, into=self.out[a:b],
                    staging=r.staging,
                )  # fmt: skip
                expected.append((site, incoming))
        return expected

    async def all_gather(self, results: list[tuple[str, Incoming]]) -> None:
        """Phase 3: this site's slice to every other member, exact; theirs in."""
        r = self.round
        sends: list[tuple[str, asyncio.Future[None]]] = []
        for site in self.members:
            if site == r.me:
                continue
            chunks = self.outgoing.encoded_chunks(
                EXACT, r.max_chunk_bytes, self.out[self.a : self.b], round=r.number,
                shard=self.gather_shard, sent=self.sent, staging=r.staging,
            )  # fmt: skip
            send = self.outgoing.send(site, chunks, round=r.number, deadline_s=r.deadline_s)
            sends.append((site, asyncio.ensure_future(send)))

        async def collect() -> None:
            for site, incoming in results:
                buffer = await self.inbox.wait_for(r, self.gather_shard, site, incoming)
                self.received += buffer.numel() * 4

        try:
            await unless_a_send_fails(collect(), [task for _, task in sends])
        except BaseException:
            for _, task in sends:
                task.cancel()
            raise
        self.outgoing.outlive(r.number, sends)

    def count(self, stats: RoundStats) -> None:
        self.sent.append(stats.bytes_sent)
        self.received += stats.bytes_received


def _refinement(partitions: list[list[tuple[int, int]]], count: int) -> list[tuple[int, int]]:
    """The pieces of [0, count) cut at every boundary of every partition (none empty)."""
    cuts = sorted({0, count, *(a for slices in partitions for a, _ in slices)})
    return [(a, b) for a, b in itertools.pairwise(cuts) if b > a]
