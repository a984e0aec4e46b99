"""Joining a job: one rank's process group, WAN endpoint and hierarchical step.

:func:`start_site` joins the in-site group, builds this rank's data-parallel
group, works out which lanes it owns and who owns them in the other sites,
starts its gRPC endpoint on a background event loop, and connects to its
counterparts (they may start in any order: the handshake waits for them up
to the deadline).
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from isthmus.inter.background import BackgroundLoop
from isthmus.inter.codecs import Codec
from isthmus.inter.hierarchical import HierarchicalStep
from isthmus.inter.lanes import RankEndpoint, lane_count, lane_owner, owned_lanes
from isthmus.inter.membership import Membership
from isthmus.inter.peer import Identity
from isthmus.inter.peer_client import PeerClient
from isthmus.inter.tls import SiteTls
from isthmus.inter.transport import TransportSettings, connections_of
from isthmus.intra.devices import compute_device
from isthmus.intra.process_group import SiteError, dp_group, init_site_group, waiting_group
from isthmus.job.addressing import SiteAddresses, resolve
from isthmus.job.layout import Layout
from isthmus.job.model import Job, SiteSpec
from isthmus.sim.cost import job_costs, job_uplinks


def layout_fingerprint(
    layout: Layout, parameters: Sequence[tuple[str, torch.Size]]
) -> tuple[str, str]:
    """(SHA-256, words) of what every site must share: tp, pp and the shapes of
    the parameters that cross the WAN."""
    words = f"tp={layout.tp} pp={layout.pp}, {len(parameters)} tensors"
    text = repr((layout.tp, layout.pp, [(n, tuple(s)) for n, s in parameters]))
    return hashlib.sha256(text.encode()).hexdigest(), words


@dataclass
class SiteRuntime:
    """This rank's membership of the job: what strategies and the step need."""

    job: Job
    site: SiteSpec
    site_index: int
    rank: int
    layout: Layout
    addresses: SiteAddresses
    lanes: int
    loop: BackgroundLoop
    endpoint: RankEndpoint
    step: HierarchicalStep
    dp_group: dist.ProcessGroup | None
    wait_group: dist.ProcessGroup | None = None
    """Every rank of the site, for collectives that wait on other sites or on the
    membership (a longer timeout than the site group's); None: the site group."""
    membership: Membership | None = None
    """Who takes part in each round, when sites may be lost and rejoin (the
    control plane carries it); None: every site of the job, always."""
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    """Where this rank computes (``train.device`` resolved): every tensor of an
    in-site collective is made here (:mod:`isthmus.intra.collectives`)."""
    _round: int = -1

    @property
    def name(self) -> str:
        return self.site.name

    @property
    def names(self) -> list[str]:
        """Every site of the job, in the job file's order."""
        return [s.name for s in self.job.sites]

    @property
    def dp_rank(self) -> int:
        return self.layout.dp_rank(self.rank)

    def next_round(self) -> int:
        """The next round number: every site advances it identically."""
        self._round += 1
        return self._round

    @property
    def engine_round(self) -> int:
        """The last round number handed out."""
        return self._round

    def skip_to_round(self, round: int) -> None:
        """Number the next round ``round`` (a new membership view's first): chunks of
        the rounds skipped are stragglers of abandoned rounds, dropped on arrival."""
        if round <= self._round:
            raise ValueError(f"round {round} is not after round {self._round}")
        self._round = round - 1

        async def skip() -> None:
            for engine in self.endpoint.engines.values():
                engine.skip_to(round)

        self.loop.run(skip())

    def client_for(self, site: str) -> PeerClient:
        """This rank's session with its counterpart in ``site`` (its first lane's)."""
        engine = self.endpoint.engines[min(self.endpoint.engines)]
        return engine.clients[site]

    def state_dict(self, *, copy: bool = True) -> dict[str, Any]:
        """What a checkpoint taken between rounds carries of the membership: the
        round counter and the engines' error-feedback residuals (per lane).
        ``copy=False``: a cheap snapshot, taken before an exchange that a
        checkpoint may catch in flight (see ``CrossSiteAllReduce.feedback_state``)."""
        return {
            "round": self._round,
            "feedback": {
                lane: e.feedback_state(copy=copy) for lane, e in self.endpoint.engines.items()
            },
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._round = int(state["round"])
        for lane, residuals in state["feedback"].items():
            self.endpoint.engines[lane].load_feedback_state(residuals)

    def set_codec(self, codec: Codec) -> None:
        """What this rank encodes from the next round on (receivers decode whatever
        codec a chunk names, so sites may switch at different rounds)."""
        for engine in self.endpoint.engines.values():
            engine.codec = codec

    def close(self, flush_s: float | None = None) -> None:
        """Close the peer service; ``flush_s``: how long to wait for the peers'
        acknowledgements first (None: the engine's default; 0: the run was stopped)."""
        if self.loop.loop.is_closed():
            return
        try:
            self.loop.run(self.endpoint.close(flush_s), timeout=30)
        finally:
            self.loop.close()

    def __enter__(self) -> SiteRuntime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def runtime_of(site: Any) -> Any:
    """The :class:`SiteRuntime` a higher-level handle holds (``isthmus.join()`` returns
    a ``Site`` with ``.runtime``), or ``site`` itself."""
    runtime = getattr(site, "runtime", None)
    return runtime if isinstance(runtime, SiteRuntime) else site


def start_site(
    job: Job,
    site: str,
    *,
    parameters: Sequence[tuple[str, torch.Size]] = (),
    state: dict | None = None,
    codec: Codec | None = None,
    deadline_s: float = 120.0,
    backend: str | None = None,
    rejoining: bool = False,
    collective_timeout_s: float | None = None,
    site_wait_s: float | None = None,
    device: torch.device | str | None = None,
) -> SiteRuntime:
    """Start this rank of ``site``. ``parameters``: (name, shape) of what will cross
    the WAN, for the layout check at the handshake. ``state``: the emulator's
    state file contents, when sites talk through ``isthmus wan``. ``rejoining``: the
    other sites are training already, and some may be down: connect to those that
    answer, and to the others when they come back. ``collective_timeout_s``: the
    site group's timeout (a hung rank); ``site_wait_s``: the timeout of the groups
    whose collectives wait on other sites (see :class:`SiteRuntime`). ``device``:
    where this rank computes (default: ``train.device`` resolved for this rank)."""
    try:
        spec = job.site(site)
    except KeyError as exc:
        raise SiteError(exc.args[0]) from None
    # Resolved before the group starts: a job asking for a GPU this machine lacks
    # fails here, naming the setting, not at its first collective.
    device = compute_device(job.train.device) if device is None else torch.device(device)
    rank = init_site_group(site, spec.ranks, backend, collective_timeout_s)
    layout = spec.layout
    group = dp_group(layout, rank) if spec.ranks > 1 else None
    waiting = dp_waiting = None
    if spec.ranks > 1 and site_wait_s is not None:
        waiting = waiting_group(spec.ranks, site_wait_s)
        dp_waiting = dp_group(layout, rank, timeout_s=site_wait_s)
    addresses = resolve(job, site, state)
    lanes = lane_count([s.layout.dp for s in job.sites])
    coords = layout.coordinates(rank)
    lane_peers = {
        lane: {
            other.name: "{}:{}".format(
                *addresses.peers[other.name][
                    other.layout.rank_of(
                        pp=coords["pp"],
                        dp=lane_owner(lane, other.layout.dp, lanes),
                        tp=coords["tp"],
                    )
                ]
            )
            for other in job.sites
            if other.name != site
        }
        for lane in owned_lanes(layout.dp_rank(rank), layout.dp, lanes)
    }
    fingerprint, words = layout_fingerprint(layout, parameters)
    identity = Identity(
        job=job.name, site=site, rank=rank, layout_fingerprint=fingerprint, layout=words
    )
    tls = (
        SiteTls.load(job.name, site, *job.tls.paths(site), crl=job.tls.crl_path)
        if job.tls is not None
        else None
    )
    settings = TransportSettings(tls=tls, connections_per_peer=connections_of(job, site))
    loop = BackgroundLoop(name=f"isthmus-wan-{site}-{rank}")
    endpoint = None
    try:
        endpoint = loop.run(
            _endpoint(identity, lane_peers, job, codec, deadline_s, settings, lanes)
        )
        host, port = addresses.listen[rank]
        loop.run(endpoint.start(host, port))
        loop.run(endpoint.connect(lenient=rejoining))
    except BaseException:
        # Stop the gRPC server in its own loop before closing it: a server left to
        # the garbage collector schedules its shutdown on a closed loop, and the
        # site's one-line error ends in a traceback ("Event loop is closed").
        if endpoint is not None:
            with contextlib.suppress(Exception):
                loop.run(endpoint.close())
        loop.close()
        raise
    step = HierarchicalStep(
        endpoint=endpoint,
        loop=loop,
        lanes=lanes,
        dp_rank=layout.dp_rank(rank),
        dp_size=layout.dp,
        dp_group=group,
        timeout_s=deadline_s * 2,
        wait_group=waiting,
        dp_wait_group=dp_waiting,
        device=device,
        # The engine encodes on the device: only encoded bytes cross to the host.
        wan_device=device,
        algorithm=job.algorithm,
    )
    return SiteRuntime(
        job=job,
        site=spec,
        site_index=[s.name for s in job.sites].index(site),
        rank=rank,
        layout=layout,
        addresses=addresses,
        lanes=lanes,
        loop=loop,
        endpoint=endpoint,
        step=step,
        dp_group=group,
        wait_group=waiting,
        device=device,
    )


async def _endpoint(
    identity: Identity,
    lane_peers: dict[int, dict[str, str]],
    job: Job,
    codec: Codec | None,
    deadline_s: float,
    settings: TransportSettings,
    lanes: int,
) -> RankEndpoint:
    # What the cost model knows of the links: the job's emulated ones (a job on a
    # real WAN states none, and its algorithm is never auto), and the sites' uplink
    # caps, which gather fills (S - 1) times over.
    link_costs, regions = job_costs(job)
    # Built on the loop that will run it: grpc.aio binds to the running loop.
    return RankEndpoint(
        identity,
        lane_peers,
        [s.name for s in job.sites],
        codec=codec,
        deadline_s=deadline_s,
        settings=settings,
        link_costs=link_costs,
        regions=job.region_of(),
        region_egress_bytes_per_s=None if regions is None else regions.egress_bytes_per_s,
        uplink_bytes_per_s=job_uplinks(job, lanes),
    )
