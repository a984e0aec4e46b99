"""The engine: one rank's end of the cross-site all-reduce, and the rounds it runs.

It owns the peer lifecycle (a server, or a share of one; a session per peer;
closing with the last sends flushed) and the bookkeeping of rounds (which
rounds run, which chunks are kept, the stats of the last one). Each round it
checks the caller's arguments once, picks the algorithm and hands it a
:class:`~.rounds.Round`: the direct algorithm (:mod:`.direct`), the gather
(:mod:`.gather`), the ring (:mod:`.ring`) or the two-level one
(:mod:`.two_level`), which move the chunks through the engine's incoming buffers
(:mod:`.incoming`) and its sends (:mod:`.sending`).

The caller decides which sites take part and with what weights (the strategy
seals that decision for the round); the engine never decides membership. A
contribution that is not finite, or of the wrong size, is refused with an
error naming the site; a peer that does not deliver by the deadline fails the
round with an error naming the site and its address.

The tensor may live on any device (a GPU's pseudo-gradient): the round's
buffers, its reduction and its error-feedback residual stay there, and only
encoded bytes cross to the host and back (:mod:`isthmus.inter.staging`). The
result is on the tensor's device, ready on every stream when the round returns.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections import Counter
from collections.abc import Mapping, Sequence

import torch

from isthmus.inter.allreduce.direct import direct_allreduce
from isthmus.inter.allreduce.feedback import ErrorFeedback
from isthmus.inter.allreduce.gather import gather_allreduce
from isthmus.inter.allreduce.incoming import Inbox
from isthmus.inter.allreduce.ring import ring_allreduce
from isthmus.inter.allreduce.rounds import (
    EXACT,
    Round,
    RoundError,
    RoundStats,
    all_finite,
    slice_bounds,
)
from isthmus.inter.allreduce.sending import ChunkFilter, Outgoing
from isthmus.inter.allreduce.two_level import two_level_allreduce
from isthmus.inter.chunks import ReceivedChunk
from isthmus.inter.codecs import Codec
from isthmus.inter.peer import Identity, PeerError, PeerServer
from isthmus.inter.peer_client import PeerClient
from isthmus.inter.staging import Staging, staging_for
from isthmus.inter.transport import TransportSettings
from isthmus.sim.cost import ALGORITHM_COSTS, LOSSY_ALGORITHMS, LinkLookup, choose

log = logging.getLogger(__name__)

AUTO_GATHER_MAX_HELD_BYTES = 1 << 30
"""Most float32 bytes of other sites' contributions a gather round chosen by ``auto``
may hold at once on the values' device: gather is for rounds the latency decides,
and a round this large is decided by its bytes (where direct wins anyway)."""
LENIENT_HELLO_S = 5.0
"""How long a lenient connect waits for each peer's handshake."""
FLUSH_ON_CLOSE_S = 20.0
"""How long :meth:`CrossSiteAllReduce.close` waits for the acknowledgements of chunks
sent by rounds that are over here (a peer may still need them to finish its round)."""
ALGORITHMS = ("direct", "gather", "ring", "two_level", "auto")


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
        regions: Mapping[str, str] | None = None,
        region_egress_bytes_per_s: Mapping[str, float] | None = None,
        lane: int = 0,
        server: PeerServer | None = None,
        chunk_filter: ChunkFilter | None = None,
        staging: Staging | None = None,
    ) -> None:
        """``peers``: site -> address of this rank's counterpart there. ``link_costs``
        (the same on every site: configured, or measured and sealed by the strategy)
        lets ``algorithm="auto"`` pick the algorithm the cost model predicts fastest.
        ``regions`` (site -> region, the job's ``regions:``) makes ``two_level``
        possible, and ``region_egress_bytes_per_s`` tells the cost model the
        regions' shared long-haul capacity.

        ``lane`` and ``server``: a rank that owns several lanes (see
        :mod:`isthmus.inter.lanes`) runs one engine per lane on one shared server,
        which hands each engine the chunks of its lane; ``peers`` are then the
        lane's counterparts. Without ``server`` the engine runs its own.

        ``chunk_filter``: applied to each outgoing chunk after its checksum, for
        faults in tests and the fault benchmark (see :mod:`.faults`); None, the
        default, sends chunks as they are.

        ``staging``: how encoded bytes move between the tensors' device and the
        host; None, the default, takes the shared one of each round's tensor's
        device (:func:`isthmus.inter.staging.staging_for`). A round whose tensor
        is on another device than a given staging's is refused."""
        self.link_costs = link_costs
        self.uplink_bytes_per_s = dict(uplink_bytes_per_s or {})
        self.regions = dict(regions or {})
        self.region_egress_bytes_per_s = dict(region_egress_bytes_per_s or {})
        self.last_algorithm: str | None = None
        self.rounds_by_algorithm: Counter[str] = Counter()
        """How many rounds each algorithm ran (``auto`` picks per round)."""
        self.identity = identity
        self.peers = dict(peers)
        self.codec = codec or Codec()
        """What this rank encodes from the next round on (a round keeps its own)."""
        self.settings = settings or TransportSettings()
        self.deadline_s = deadline_s
        self.lane = lane
        self._owns_server = server is None
        if server is None:
            sites = {identity.site, *self.peers}
            server = PeerServer(identity, sites, self.receive, settings=self.settings)
        self.server = server
        self.clients: dict[str, PeerClient] = {}
        self.inbox = Inbox(self.settings.max_early_bytes_per_site)
        self.outgoing = Outgoing(self.clients, lane=lane, chunk_filter=chunk_filter)
        self.error_feedback = ErrorFeedback()
        self.staging = staging
        self.last: RoundStats | None = None
        self._warned_ring = False

    # The sends' counters, read by telemetry, the benchmarks and the tests.
    @property
    def bytes_sent_to(self) -> dict[str, int]:
        """Payload bytes sent to each site over this engine's life (per link)."""
        return self.outgoing.bytes_sent_to

    @property
    def bytes_received_from(self) -> dict[str, int]:
        """Payload bytes received from each site over this engine's life (per link)."""
        return self.inbox.bytes_received_from

    @property
    def resent_chunks(self) -> int:
        """Chunks sent again: refused as corrupted, or unanswered when a stream broke."""
        return self.outgoing.resent_chunks

    @property
    def broken_streams(self) -> int:
        return self.outgoing.broken_streams

    @property
    def times_refused(self) -> Counter[int]:
        """Chunks refused k times before they passed, by k (see MAX_REFUSALS)."""
        return self.outgoing.times_refused

    @property
    def failed_deliveries(self) -> int:
        """Sends that failed after their round was over here (each logged)."""
        return self.outgoing.failed_deliveries

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        return await self.server.start(host, port)

    def feedback_state(self, *, copy: bool = True) -> dict[str, torch.Tensor]:
        """The error-feedback residuals, per vector: part of a checkpoint taken
        between rounds (with a lossy codec, resuming without them would differ).
        ``copy=False``: the residual tensors themselves, a snapshot all the same,
        since a round replaces a vector's residual and never changes it in place."""
        return self.error_feedback.state(copy=copy)

    def load_feedback_state(self, residuals: Mapping[str, torch.Tensor]) -> None:
        self.error_feedback.load_state(residuals)

    async def connect(self, *, lenient: bool = False) -> None:
        """Open a session with every peer (handshake checks job, protocol, layout).
        ``lenient``: a peer that does not answer within ``LENIENT_HELLO_S``, or
        refuses, is kept without a handshake (a site rejoining a run where others may
        be down, or not know it yet: the first exchange with it tries again)."""
        for site, address in self.peers.items():
            client = self._client(site, address)
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
        self.clients[site] = self._client(site, address)

    def _client(self, site: str, address: str) -> PeerClient:
        return PeerClient(
            self.identity,
            address,
            settings=self.settings,
            deadline_s=self.deadline_s,
            peer_site=site,
        )

    async def close(self, flush_s: float = FLUSH_ON_CLOSE_S) -> None:
        """Wait up to ``flush_s`` for the acknowledgements a peer may still need (0: a
        stopped run, whose peers are stopping too: give them up at once), then close."""
        await self.flush(flush_s)
        for client in self.clients.values():
            await client.close()
        if self._owns_server:
            await self.server.stop()
        self.outgoing.shutdown()

    async def flush(self, timeout_s: float | None = None) -> None:
        """Wait until the chunks of rounds that are over here are acknowledged (or
        their delivery failed, which is logged); after ``timeout_s``, stop waiting
        and cancel the rest, naming them."""
        await self.outgoing.flush(timeout_s)

    def receive(self, chunk: ReceivedChunk) -> bool:
        """Take a verified chunk of this engine's lane from the server; raise
        :class:`ChunkError` to refuse one that no round can use. False: dropped, its
        round being over here."""
        return self.inbox.receive(chunk)

    def skip_to(self, round: int) -> None:
        """The next round is ``round`` or later: chunks of earlier rounds are dropped
        (those of rounds still running stay until they end)."""
        self.inbox.skip_to(round)

    async def allreduce(
        self,
        tensor: torch.Tensor,
        *,
        round: int,
        participants: Sequence[str],
        weights: Mapping[str, float],
        algorithm: str = "direct",
        feedback: str | None = None,
        exact: bool = False,
    ) -> torch.Tensor:
        """The weighted average of ``tensor`` over ``participants`` (this site among them).

        ``exact``: this round crosses as float32 whatever the engine's codec (a
        round's seal, whose counts and flags must come through unchanged).

        ``feedback``: error feedback for a lossy codec, keyed by this name (one per
        vector the caller sends again and again, e.g. ``"model"`` or a fragment's
        name): what the codec lost of this site's contribution is added to the
        next contribution under the same key, so the losses do not accumulate
        over rounds. Not with the ring (it says once that it is off);
        nothing to do with ``none``.

        ``algorithm``: ``direct`` (full mesh: every site owns a slice; a value is
        encoded twice), ``gather`` (every site sends its whole contribution to every
        other site and reduces them all itself: one one-way trip instead of two, for
        S / 2 times direct's bytes on each uplink and S - 1 float32 copies of the
        vector held during the round; a value is encoded twice, as with direct),
        ``ring`` (each site talks to its successor only; partial
        sums are re-encoded at every hop, so a value is encoded up to S times),
        ``two_level`` (inside each region, across regions between counterparts,
        inside again; a value is encoded three times; needs ``regions``), or
        ``auto`` (the one :mod:`isthmus.sim.cost` predicts fastest on ``link_costs``)."""
        # Several rounds may be in flight at once (gradient buckets, overlapped
        # fragments): the inbox keeps the chunks of every round from the oldest
        # one running on.
        self.inbox.enter(round)
        try:
            return await self._run_round(
                tensor,
                round=round,
                participants=participants,
                weights=weights,
                algorithm=algorithm,
                feedback=feedback,
                exact=exact,
            )
        finally:
            self.inbox.leave(round)

    async def _run_round(
        self,
        tensor: torch.Tensor,
        *,
        round: int,
        participants: Sequence[str],
        weights: Mapping[str, float],
        algorithm: str,
        feedback: str | None,
        exact: bool = False,
    ) -> torch.Tensor:
        """One round of :meth:`allreduce`: check, plan, run the algorithm, keep its stats."""
        codec = EXACT if exact else self.codec
        algorithm = self._pick_algorithm(algorithm, tensor, participants, codec, weights)
        sites = sorted(participants)
        self._check_participants(round, sites, weights)
        if len(sites) == 1:
            algorithm = "direct"  # a lone site: every algorithm is its own values
        self.last_algorithm = algorithm
        self.rounds_by_algorithm[algorithm] += 1
        flat = self._own_values(tensor, round)
        staging = self._staging_for(flat.device)
        loop = asyncio.get_running_loop()
        started = loop.time()
        plan = Round(
            number=round,
            sites=sites,
            me=self.identity.site,
            weights=weights,
            bounds=slice_bounds(flat.numel(), len(sites)),
            codec=codec,
            max_chunk_bytes=self.settings.max_chunk_bytes,
            started=started,
            deadline=started + self.deadline_s,
            deadline_s=self.deadline_s,
            addresses=self.peers,
            staging=staging,
        )
        if algorithm == "two_level":
            out, self.last = await two_level_allreduce(
                plan,
                flat,
                region_of=self.regions,
                inbox=self.inbox,
                outgoing=self.outgoing,
                feedback=self.error_feedback,
                key=feedback,
            )
        elif algorithm == "ring":
            self._say_feedback_is_off(round, feedback)
            out, self.last = await ring_allreduce(
                plan, flat, inbox=self.inbox, outgoing=self.outgoing
            )
        else:
            # A full mesh: one trip (gather) or two (direct, also for a lone site).
            mesh = gather_allreduce if algorithm == "gather" else direct_allreduce
            out, self.last = await mesh(
                plan,
                flat,
                inbox=self.inbox,
                outgoing=self.outgoing,
                feedback=self.error_feedback,
                key=feedback,
            )
        # The last decodes may still run on the device: the caller may read the
        # result from another stream or thread (CPU: nothing to wait for).
        staging.settle()
        return out.view_as(tensor)

    def _staging_for(self, device: torch.device) -> Staging:
        if self.staging is None:
            return staging_for(device)
        if self.staging.device != device:
            raise ValueError(
                f"this engine stages for {self.staging.device}, got a tensor on {device}; "
                "pass tensors on that device, or staging=None"
            )
        return self.staging

    def _pick_algorithm(
        self,
        algorithm: str,
        tensor: torch.Tensor,
        participants: Sequence[str],
        codec: Codec | None = None,
        weights: Mapping[str, float] | None = None,
    ) -> str:
        if algorithm not in ALGORITHMS:
            raise ValueError(
                f"unknown algorithm {algorithm!r}; use direct, gather, ring, two_level or auto"
            )
        if algorithm == "two_level" and not self.regions:
            raise ValueError(
                "the two_level algorithm needs the sites' regions (the job file's regions:); "
                "use direct, gather, ring or auto"
            )
        codec = codec or self.codec
        if codec.sparse is not None:
            # The ring re-encodes partial sums at every hop: top-k of a partial sum
            # drops what earlier sites sent, and no site's feedback can send it again.
            if algorithm == "ring":
                raise ValueError(
                    "the topk codec needs the direct or gather algorithm (the ring would "
                    "re-select the largest values of every partial sum): use algorithm "
                    "direct, gather or auto"
                )
            if algorithm == "gather":
                return algorithm
            if algorithm != "auto" or self.link_costs is None:
                return "direct"
            # Direct's owners send back the union of the positions the contributing
            # sites sent (4-bit values): more bytes than a contribution, which is all
            # gather sends. A site of weight 0 sends nothing and widens no union.
            contributing = [s for s in participants if weights is None or weights.get(s, 0) > 0]
            result = codec.for_sum_of(len(contributing))
            fits = self._gather_fits(tensor, participants)
            return choose(
                tensor.numel() * codec.bytes_per_value(),
                sorted(participants),
                self.link_costs,
                self.uplink_bytes_per_s,
                among=("direct", "gather") if fits else ("direct",),
                result_nbytes=tensor.numel() * result.bytes_per_value(),
            )
        if algorithm != "auto":
            return algorithm
        if self.link_costs is None:
            raise ValueError("algorithm 'auto' needs link costs: pass link_costs=...")
        # What crosses is encoded: a 2-bit round moves a sixteenth of float32's bytes,
        # and on long links that decides between one trip and two.
        usable = ALGORITHM_COSTS if codec.name == "none" else LOSSY_ALGORITHMS
        return choose(
            tensor.numel() * codec.bytes_per_value(),
            sorted(participants),
            self.link_costs,
            self.uplink_bytes_per_s,
            regions=self.regions or None,
            region_egress_bytes_per_s=self.region_egress_bytes_per_s,
            among=[
                name
                for name in usable
                if name != "gather" or self._gather_fits(tensor, participants)
            ],
        )

    def _gather_fits(self, tensor: torch.Tensor, participants: Sequence[str]) -> bool:
        """Whether ``auto`` may take gather for ``tensor``: it holds every other site's
        contribution whole, as float32, for the round (direct holds a slice of each)."""
        return (len(participants) - 1) * tensor.numel() * 4 <= AUTO_GATHER_MAX_HELD_BYTES

    def _check_participants(
        self, round: int, sites: list[str], weights: Mapping[str, float]
    ) -> None:
        me = self.identity.site
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

    def _own_values(self, tensor: torch.Tensor, round: int) -> torch.Tensor:
        """``tensor`` as one flat float32 vector, refused if not finite: this site's
        own NaN must never reach the others. On a GPU the check is a sync point:
        the tensor must be complete on the current stream (see the module doc)."""
        if tensor.dtype != torch.float32:
            raise ValueError(f"expected a float32 tensor, got {tensor.dtype}")
        flat = tensor.detach().reshape(-1).contiguous()
        if not all_finite(flat):
            bad = int((~torch.isfinite(flat)).sum())
            raise RoundError(
                self.identity.site,
                f"round {round}: this site's own tensor holds {bad} NaN/Inf values; not sent",
            )
        return flat

    def _say_feedback_is_off(self, round: int, feedback: str | None) -> None:
        if feedback is not None and self.codec.name != "none" and not self._warned_ring:
            # The ring re-encodes partial sums at every hop: a site's own loss
            # is not separable from the others'. Say so once, do not fail.
            log.warning("round %d: error feedback is off with the ring algorithm", round)
            self._warned_ring = True
