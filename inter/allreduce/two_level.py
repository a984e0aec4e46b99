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

Phases 1 and 2 overlap: a large tensor's slices are reduced inside the region
in up to four parts (:func:`isthmus.sim.cost.two_level_parts`), one after
another, and each part goes across as soon as it is reduced, while the next is
reduced. On fast links inside a region the reduce-scatter is short, but where
many sites share a machine's cores it was a sixth of the round, spent before the
long links carried anything.

Inside a region each site sends ``2 (m - 1) N / m``, as the flat algorithm
would among m sites. A value is encoded three times on its way (its
contribution inside, its region's share across, the owner's result across);
phase 3 adds no error. Error feedback: phase 1 under the caller's key (what
this site's own contribution lost), phase 2 under ``key/across/p`` (what its
region's share of piece p lost; phase 1 in K > 1 parts keeps part j's under
``key/inside/j``). Wire shards: part j of phase 1 uses ``[2S j, 2S (j + 1))``,
piece p of phase 2 ``[2S (K + p), 2S (K + p + 1))``, and phase 3 ``2S (K + P)``
(P pieces), so no chunk lands in another phase's buffers.
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
from isthmus.sim.cost import two_level_parts


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
        # Every site computes the same K (from n and the largest region): the shard
        # numbers across regions depend on it.
        largest = max(len(m) for m in self.groups.values())
        self.parts = two_level_parts(4 * n, largest)  # the cost model's rule, float32
        self.part_slices = {
            r: [_split(bounds, self.parts) for bounds in slices]
            for r, slices in self.slices.items()
        }
        """Each region's members' slices cut into K parts: part j of every member's."""
        cuts = [parts for slices in self.part_slices.values() for parts in slices]
        self.pieces = _refinement([list(c) for c in cuts], n)
        self.stride = stride = 2 * len(round.sites)
        self.gather_shard = stride * (self.parts + len(self.pieces))
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
        reduced = [asyncio.Event() for _ in range(self.parts)]
        mine = [p for p, (lo, hi) in enumerate(self.pieces) if self.a <= lo < self.b]
        own_parts = self.part_slices[self.region][self.members.index(r.me)]

        async def across_when_reduced(p: int) -> None:
            lo = self.pieces[p][0]
            await reduced[next(j for j, (a, b) in enumerate(own_parts) if a <= lo < b)].wait()
            await self.across(p)

        tasks = [
            asyncio.ensure_future(self.reduce_scatter(reduced)),
            *(asyncio.ensure_future(across_when_reduced(p)) for p in mine),
        ]
        try:
            try:
                await asyncio.gather(*tasks)
            except BaseException:
                # A failure in either phase ends the other's tasks; the round fails
                # with the first failure itself (not a group of them).
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                raise
            self.phases["across"] = loop.time() - r.started
            await self.all_gather(results)
        except BaseException:
            for site, _ in results:
                self.inbox.forget(r.number, self.gather_shard, site)
            raise
        self.phases["results"] = loop.time() - r.started
        stats = RoundStats(sum(self.sent), self.received, loop.time() - r.started, self.phases)
        return self.out, stats

    async def reduce_scatter(self, reduced: list[asyncio.Event]) -> None:
        """Phase 1: this site's slice of the region's weighted average, into ``out``,
        in K parts one after another, each part's event set once it is in (never on
        a failure: the round then cancels the parts waiting to go across)."""
        if len(self.members) == 1:
            self.out.copy_(self.flat)
        elif self.weight_of[self.region] == 0:
            # Nobody here counts this round: the region takes part with weight 0.
            self.out[self.a : self.b] = 0
        else:
            for j in range(self.parts):
                await self.reduce_part(j)
                reduced[j].set()
        for event in reduced:
            event.set()
        self.phases["inside"] = asyncio.get_running_loop().time() - self.round.started

    async def reduce_part(self, j: int) -> None:
        """Part j of phase 1: part j of every member's slice, packed into one vector
        (its own error-feedback key where there are several parts)."""
        r = self.round
        parts = [slices[j] for slices in self.part_slices[self.region]]
        # One part is every slice whole, which is ``flat`` itself: no copy.
        packed = self.flat if self.parts == 1 else torch.cat([self.flat[a:b] for a, b in parts])
        bounds, start = [], 0
        for a, b in parts:
            bounds.append((start, start + b - a))
            start += b - a
        plan = dataclasses.replace(r, sites=self.members, bounds=bounds, shard_base=self.stride * j)
        key = self.key if self.key is None or self.parts == 1 else f"{self.key}/inside/{j}"
        result, stats = await direct_allreduce(
            plan, packed, inbox=self.inbox, outgoing=self.outgoing,
            feedback=self.feedback, key=key, gather=False,
        )  # fmt: skip
        mine = self.members.index(r.me)
        (a, b), (pa, pb) = parts[mine], bounds[mine]
        self.out[a:b] = result[pa:pb]
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
            shard_base=self.stride * (self.parts + p),
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
                await self.inbox.wait_for(r, self.gather_shard, site, incoming)
                self.received += incoming.received_bytes

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


def _split(bounds: tuple[int, int], parts: int) -> list[tuple[int, int]]:
    """``bounds`` cut into ``parts`` contiguous parts (sizes differing by <= 1)."""
    a, _ = bounds
    return [(a + lo, a + hi) for lo, hi in slice_bounds(bounds[1] - a, parts)]


def _refinement(partitions: list[list[tuple[int, int]]], count: int) -> list[tuple[int, int]]:
    """The pieces of [0, count) cut at every boundary of every partition (none empty)."""
    cuts = sorted({0, count, *(a for slices in partitions for a, _ in slices)})
    return [(a, b) for a, b in itertools.pairwise(cuts) if b > a]
