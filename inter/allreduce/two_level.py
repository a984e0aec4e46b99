"""The two-level all-reduce: inside each region, across regions between counterparts, inside again.

Sites of one region (the job's ``regions:``) share fast links and one long-haul
capacity. The flat direct algorithm sends every site's share to every other
site, so a region of m of the S sites pushes ``m (S - m) N / S`` bytes through
its long-haul in each phase. In two levels a region pushes ``(K - 1) N / K``
(K regions), and every member carries its part of it:

1. **Inside the region**, the direct algorithm over its fast links: every
   member ends with the region's weighted average, bitwise identical across
   the region (its owners encode once).
2. **Across regions**: the tensor is cut into Q slices, Q the largest region's
   size. Member k of a region of m members takes the slices j with
   ``j mod m == k``; for each, it runs the direct algorithm with the members
   that take j in the other regions (its counterparts), each contributing
   its region's average weighted by the region's total weight. The average of
   region averages so weighted is the global weighted average, and every
   counterpart ends with slice j of it, identical (its owners encode once).
3. **Inside again**: each member sends its slices' results to the others of
   its region as float32, exact, over the fast links. So every site of every
   region ends with the same bytes.

A value is encoded four times on its way (twice in each direct exchange);
phase 3 adds no error. Error feedback: phase 1 under the caller's key (what
this site's own contribution lost), phase 2 under ``key/across/j`` (what its
share of the region's average lost). Wire shards: phase 1 uses the direct
algorithm's ``[0, 2S)``, slice j of phase 2 ``[2S (1 + j), 2S (2 + j))``, and
phase 3 ``2S (1 + Q) + j``, so no chunk lands in another phase's buffers.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Mapping

import torch

from isthmus.inter.allreduce.direct import direct_allreduce
from isthmus.inter.allreduce.feedback import ErrorFeedback
from isthmus.inter.allreduce.incoming import Inbox, Incoming
from isthmus.inter.allreduce.rounds import Round, RoundStats, slice_bounds
from isthmus.inter.allreduce.sending import Outgoing, unless_a_send_fails
from isthmus.inter.codecs import Codec

EXACT = Codec()


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
        self.slices = slice_bounds(flat.numel(), max(len(m) for m in self.groups.values()))
        stride = 2 * len(round.sites)
        self.across_base = [stride * (1 + j) for j in range(len(self.slices))]
        self.inside_base = stride * (1 + len(self.slices))
        self.out = torch.empty_like(flat)
        self.sent: list[int] = []
        self.received = 0
        self.phases: dict[str, float] = {}

    def takes(self, site: str, j: int) -> bool:
        """Whether ``site`` (of this region) takes slice ``j`` across regions."""
        return self.members.index(site) == j % len(self.members)

    def counterparts(self, j: int) -> list[str]:
        """The sites that take slice ``j`` across regions, one per region, sorted."""
        return sorted(members[j % len(members)] for members in self.groups.values())

    async def run(self) -> tuple[torch.Tensor, RoundStats]:
        loop = asyncio.get_running_loop()
        r = self.round
        # Phase 3's buffers first: a member quicker across regions may send early.
        results = self.expect_results()
        try:
            average = await self.inside()
            self.phases["inside"] = loop.time() - r.started
            mine = [j for j in range(len(self.slices)) if self.takes(r.me, j)]
            await asyncio.gather(*(self.across(j, average) for j in mine))
            self.phases["across"] = loop.time() - r.started
            await self.share(mine, results)
        except BaseException:
            for j, site, _ in results:
                self.inbox.forget(r.number, self.inside_base + j, site)
            raise
        self.phases["results"] = loop.time() - r.started
        stats = RoundStats(sum(self.sent), self.received, loop.time() - r.started, self.phases)
        return self.out, stats

    async def inside(self) -> torch.Tensor:
        """Phase 1: the region's weighted average, by the direct algorithm."""
        r = self.round
        if len(self.members) == 1:
            return self.flat
        if self.weight_of[self.region] == 0:
            # Nobody here counts this round: the region takes part with weight 0.
            return torch.zeros_like(self.flat)
        plan = dataclasses.replace(
            r, sites=self.members, bounds=slice_bounds(self.flat.numel(), len(self.members))
        )
        average, stats = await direct_allreduce(
            plan, self.flat, inbox=self.inbox, outgoing=self.outgoing,
            feedback=self.feedback, key=self.key,
        )  # fmt: skip
        self.count(stats)
        return average

    async def across(self, j: int, average: torch.Tensor) -> None:
        """Phase 2 for slice ``j``: the direct algorithm among its counterparts, each
        region weighted by its total; the result lands in ``out``."""
        r = self.round
        lo, hi = self.slices[j]
        sites = self.counterparts(j)
        if len(sites) == 1:
            self.out[lo:hi] = average[lo:hi]
            return
        weights = {s: self.weight_of[region] for region, s in self._by_region(sites)}
        plan = dataclasses.replace(
            r,
            sites=sites,
            weights=weights,
            bounds=slice_bounds(hi - lo, len(sites)),
            shard_base=self.across_base[j],
        )
        key = None if self.key is None else f"{self.key}/across/{j}"
        result, stats = await direct_allreduce(
            plan, average[lo:hi].contiguous(), inbox=self.inbox, outgoing=self.outgoing,
            feedback=self.feedback, key=key,
        )  # fmt: skip
        self.out[lo:hi] = result
        self.count(stats)

    def _by_region(self, sites: list[str]) -> list[tuple[str, str]]:
        return [(r, s) for r, members in self.groups.items() for s in members if s in sites]

    def expect_results(self) -> list[tuple[int, str, Incoming]]:
        """Phase 3's buffers: each slice another member of the region takes, decoded
        straight into its place in ``out``."""
        r = self.round
        expected = []
        for j, (lo, hi) in enumerate(self.slices):
            for site in self.members:
                if site != r.me and self.takes(site, j):
                    incoming = self.inbox.expect(
                        r.number, self.inside_base + j, site, hi - lo,
                        into=self.out[lo:hi], staging=r.staging,
                    )  # fmt: skip
                    expected.append((j, site, incoming))
        return expected

    async def share(self, mine: list[int], results: list[tuple[int, str, Incoming]]) -> None:
        """Phase 3: this site's slices to every other member, exact; theirs in."""
        r = self.round
        sends: list[tuple[str, asyncio.Future[None]]] = []
        for site in self.members:
            if site == r.me:
                continue
            for j in mine:
                lo, hi = self.slices[j]
                chunks = self.outgoing.encoded_chunks(
                    EXACT, r.max_chunk_bytes, self.out[lo:hi], round=r.number,
                    shard=self.inside_base + j, sent=self.sent, staging=r.staging,
                )  # fmt: skip
                send = self.outgoing.send(site, chunks, round=r.number, deadline_s=r.deadline_s)
                sends.append((site, asyncio.ensure_future(send)))

        async def collect() -> None:
            for j, site, incoming in results:
                await self.inbox.wait_for(r, self.inside_base + j, site, incoming)
                lo, hi = self.slices[j]
                self.received += (hi - lo) * 4

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
