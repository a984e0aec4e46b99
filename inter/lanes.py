"""Lanes: how the ranks of sites of different sizes share the cross-site traffic.

Within a site, the data-parallel ranks of one (pipeline, tensor) coordinate
hold the same logical vector (their share of the model). Across sites these
groups may differ in size: a 2-rank site may meet a 1-rank one. The vector is
cut into ``L = lcm(group sizes of all sites)`` equal lanes; in a site whose
group has ``d`` ranks, data-parallel rank ``r`` owns the ``L / d`` consecutive
lanes ``[r L / d, (r + 1) L / d)``. Every lane is an all-reduce of its own
between its owner in each site, so every rank carries exactly ``1 / d`` of its
site's WAN traffic, and a lane's counterparts are known from the lane number
alone.

A rank serves all its lanes on one gRPC endpoint (:class:`RankEndpoint`),
which hands each chunk to the engine of the lane the chunk names.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Collection, Mapping, Sequence

import torch

from isthmus.inter.allreduce import CrossSiteAllReduce, RoundStats
from isthmus.inter.chunks import ChunkError, ReceivedChunk
from isthmus.inter.codecs import Codec
from isthmus.inter.peer import Identity, PeerServer
from isthmus.inter.transport import TransportSettings
from isthmus.proto import wire_pb2
from isthmus.sim.cost import LinkLookup

MAX_LANES = 4096
"""More lanes than this means group sizes with a huge least common multiple
(e.g. 61 and 67 ranks): refused, with the advice to use sizes that divide each other."""


def lane_count(group_sizes: Sequence[int]) -> int:
    """Lanes for sites whose data-parallel groups have these sizes."""
    if not group_sizes or min(group_sizes) < 1:
        raise ValueError(f"group sizes must be >= 1, got {list(group_sizes)}")
    lanes = math.lcm(*group_sizes)
    if lanes > MAX_LANES:
        raise ValueError(
            f"data-parallel group sizes {sorted(set(group_sizes))} need lcm = {lanes} lanes "
            f"(at most {MAX_LANES}); use sizes that divide each other, e.g. powers of two"
        )
    return lanes


def owned_lanes(dp_rank: int, dp_size: int, lanes: int) -> range:
    """The lanes data-parallel rank ``dp_rank`` of a ``dp_size`` group owns."""
    per_rank = lanes // dp_size
    return range(dp_rank * per_rank, (dp_rank + 1) * per_rank)


def lane_owner(lane: int, dp_size: int, lanes: int) -> int:
    """The data-parallel rank of a ``dp_size`` group that owns ``lane``."""
    return lane // (lanes // dp_size)


class RankEndpoint:
    """One local rank's end of the WAN: one server, one engine per lane it owns."""

    def __init__(
        self,
        identity: Identity,
        lane_peers: Mapping[int, Mapping[str, str]],
        sites: Collection[str],
        *,
        codec: Codec | None = None,
        settings: TransportSettings | None = None,
        deadline_s: float = 60.0,
        link_costs: LinkLookup | None = None,
        regions: Mapping[str, str] | None = None,
        region_egress_bytes_per_s: Mapping[str, float] | None = None,
        uplink_bytes_per_s: Mapping[str, float] | None = None,
    ) -> None:
        """``lane_peers``: for every lane this rank owns, site -> address of the
        lane's owner there. ``sites``: every site of the job. ``link_costs``,
        ``regions``, ``region_egress_bytes_per_s`` and ``uplink_bytes_per_s``: for
        ``auto`` and ``two_level`` (see :class:`CrossSiteAllReduce`)."""
        if not lane_peers:
            raise ValueError("a rank endpoint needs at least one lane")
        self.identity = identity
        self.settings = settings or TransportSettings()
        self.server = PeerServer(identity, sites, self._dispatch, settings=self.settings)
        self.engines = {
            lane: CrossSiteAllReduce(
                identity,
                peers,
                codec=codec,
                settings=self.settings,
                deadline_s=deadline_s,
                link_costs=link_costs,
                regions=regions,
                region_egress_bytes_per_s=region_egress_bytes_per_s,
                uplink_bytes_per_s=uplink_bytes_per_s,
                lane=lane,
                server=self.server,
            )
            for lane, peers in sorted(lane_peers.items())
        }

    def _dispatch(self, chunk: ReceivedChunk) -> bool:
        engine = self.engines.get(chunk.lane)
        if engine is None:
            raise ChunkError(
                wire_pb2.WRONG_SHAPE,
                f"chunk for lane {chunk.lane}, but site {self.identity.site!r} rank "
                f"{self.identity.rank} serves lanes {sorted(self.engines)}; the sites "
                f"disagree on their layouts",
            )
        return engine.receive(chunk)

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        return await self.server.start(host, port)

    def bytes_sent_to(self) -> dict[str, int]:
        """Payload bytes this rank has sent to each site, over every lane."""
        total: dict[str, int] = {}
        for engine in self.engines.values():
            for site, count in list(engine.bytes_sent_to.items()):  # atomic under the GIL
                total[site] = total.get(site, 0) + count
        return total

    def bytes_received_from(self) -> dict[str, int]:
        """Payload bytes this rank has received from each site, over every lane."""
        total: dict[str, int] = {}
        for engine in self.engines.values():
            for site, count in list(engine.bytes_received_from.items()):
                total[site] = total.get(site, 0) + count
        return total

    def rounds_by_algorithm(self) -> dict[str, int]:
        """How many rounds each all-reduce algorithm ran on this rank (its first lane's:
        every lane runs each round)."""
        engine = self.engines[min(self.engines)]
        return dict(engine.rounds_by_algorithm)  # a copy: the loop thread adds to it

    async def connect(self, *, lenient: bool = False) -> None:
        await asyncio.gather(*(engine.connect(lenient=lenient) for engine in self.engines.values()))

    async def add_site(self, site: str, lane_addresses: Mapping[int, str]) -> None:
        """Accept ``site``'s handshakes, and send each lane's share to its owner there
        (``lane_addresses``, for every lane this rank owns): a site added to the job
        while it runs. The handshake comes with the first exchange."""
        self.server.servicer.sites.add(site)
        for lane, address in lane_addresses.items():
            self.engines[lane].add_peer(site, address)

    async def close(self, flush_s: float | None = None) -> None:
        for engine in self.engines.values():
            await (engine.close() if flush_s is None else engine.close(flush_s))
        await self.server.stop()

    async def allreduce(
        self,
        values: Mapping[int, torch.Tensor],
        *,
        round: int,
        participants: Sequence[str],
        weights: Mapping[str, float],
        algorithm: str = "direct",
    ) -> dict[int, torch.Tensor]:
        """Every lane's weighted average, the lanes running at once."""
        results, _ = await self.allreduce_with_stats(
            values, round=round, participants=participants, weights=weights, algorithm=algorithm
        )
        return results

    async def allreduce_with_stats(
        self,
        values: Mapping[int, torch.Tensor],
        *,
        round: int,
        participants: Sequence[str],
        weights: Mapping[str, float],
        algorithm: str = "direct",
        feedback: str | None = None,
        exact: bool = False,
    ) -> tuple[dict[int, torch.Tensor], RoundStats]:
        """:meth:`allreduce` and this round's WAN traffic, all lanes together (right
        even when several rounds are in flight at once)."""
        missing = sorted(set(self.engines) - set(values))
        extra = sorted(set(values) - set(self.engines))
        if missing or extra:
            raise ValueError(
                f"values must cover exactly this rank's lanes {sorted(self.engines)}; "
                f"missing {missing}, not owned {extra}"
            )

        async def one(lane: int) -> tuple[torch.Tensor, RoundStats]:
            engine = self.engines[lane]
            out = await engine.allreduce(
                values[lane],
                round=round,
                participants=participants,
                weights=weights,
                algorithm=algorithm,
                feedback=feedback,
                exact=exact,
            )
            # Read at once: no other task runs between the engine setting it
            # and this line, so it is this round's.
            assert engine.last is not None
            return out, engine.last

        lanes = sorted(self.engines)
        done = await asyncio.gather(*(one(lane) for lane in lanes))
        stats = [s for _, s in done]
        total = RoundStats(
            bytes_sent=sum(s.bytes_sent for s in stats),
            bytes_received=sum(s.bytes_received for s in stats),
            seconds=max((s.seconds for s in stats), default=0.0),
        )
        return {lane: out for lane, (out, _) in zip(lanes, done, strict=True)}, total
