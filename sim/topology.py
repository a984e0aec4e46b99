"""What the emulator emulates: sites, the links between every pair, and a fault schedule.

A topology is plain data, independent of how bytes are carried. A job
(:meth:`Topology.for_job`) builds one; tests and the Python API may build one
directly. Every pair of sites has exactly one link, which carries every
connection between the two sites (all ranks, both directions), as a real
inter-region link does.
"""

from __future__ import annotations

import random
import zlib
from dataclasses import dataclass, field

from isthmus.job.fault_schedule import Fault, validate_fault
from isthmus.job.link import LinkParams
from isthmus.job.model import Job, WanSpec
from isthmus.sim.token_bucket import TokenBucket


@dataclass(frozen=True, kw_only=True)
class EmulatedSite:
    """One site as the emulator sees it: where its ranks listen, and its uplink cap."""

    name: str
    listen: tuple[tuple[str, int], ...]
    """(host, port) where each local rank's peer service listens; index = local rank."""

    uplink_mbit: float | None = None
    """Cap on the site's total WAN egress, and separately on its ingress, over all links."""

    @property
    def ranks(self) -> int:
        return len(self.listen)


@dataclass(frozen=True)
class Topology:
    """Sites, one link per pair of sites, and the fault schedule."""

    sites: tuple[EmulatedSite, ...]
    links: dict[frozenset[str], tuple[tuple[str, str], LinkParams]]
    faults: tuple[Fault, ...] = ()
    seed: int = 0
    region_of: dict[str, str] = field(default_factory=dict)
    """Each site's region (the job file's ``regions:``); empty: no regions."""
    region_egress_mbit: dict[str, float] = field(default_factory=dict)
    """Regions whose long-haul capacity is capped: Mbit/s shared by all traffic
    leaving the region for others, and separately by all traffic entering it."""

    def site(self, name: str) -> EmulatedSite:
        for site in self.sites:
            if site.name == name:
                return site
        raise KeyError(f"unknown site {name!r}; sites: {', '.join(s.name for s in self.sites)}")

    def link_params(self, a: str, b: str) -> LinkParams:
        """The link between ``a`` and ``b``, its directions ordered as (a->b, b->a)."""
        key = frozenset((a, b))
        if key not in self.links or a == b:
            raise KeyError(f"no link between {a!r} and {b!r}")
        (first, _), params = self.links[key]
        if first == a:
            return params
        return LinkParams(params.b_to_a, params.a_to_b)

    def shared_limits(self) -> SharedLimits:
        """The rate limiters that several links share (site uplinks, region egress),
        made once for an emulator: each direction takes the ones it passes through."""
        sites = {s.name: _pair(s.uplink_mbit) for s in self.sites if s.uplink_mbit is not None}
        regions = {name: _pair(mbit) for name, mbit in self.region_egress_mbit.items()}
        return SharedLimits(sites, regions, dict(self.region_of))

    def pairs(self) -> list[tuple[str, str]]:
        """Every link as (a, b) in a stable order."""
        return [pair for pair, _ in self.links.values()]

    @classmethod
    def full_mesh(
        cls,
        sites: list[EmulatedSite],
        *,
        default: LinkParams,
        overrides: dict[frozenset[str], tuple[tuple[str, str], LinkParams]] | None = None,
        faults: list[Fault] | tuple[Fault, ...] = (),
        seed: int = 0,
        region_of: dict[str, str] | None = None,
        region_egress_mbit: dict[str, float] | None = None,
    ) -> Topology:
        """Every pair of ``sites`` gets ``default`` unless ``overrides`` names it."""
        names = [s.name for s in sites]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate site names in {names}")
        overrides = overrides or {}
        links: dict[frozenset[str], tuple[tuple[str, str], LinkParams]] = {}
        for i, a in enumerate(names):
            for b in names[i + 1 :]:
                key = frozenset((a, b))
                links[key] = overrides.get(key, ((a, b), default))
        for fault in faults:
            validate_fault(fault, names)
        return cls(
            tuple(sites),
            links,
            tuple(faults),
            seed,
            dict(region_of or {}),
            dict(region_egress_mbit or {}),
        )

    @classmethod
    def for_job(cls, job: Job, listen: dict[str, list[tuple[str, int]]]) -> Topology:
        """The emulated topology of ``job``, with ``listen[site]`` the real address of
        each rank."""
        wan = job.wan or WanSpec(default=LinkParams())
        sites = [
            EmulatedSite(name=s.name, listen=tuple(listen[s.name]), uplink_mbit=s.uplink_mbit)
            for s in job.sites
        ]
        region_of = job.region_of()
        names = [s.name for s in sites]
        links = {
            frozenset((a, b)): ((a, b), wan.link_between(a, b, region_of))
            for i, a in enumerate(names)
            for b in names[i + 1 :]
        }
        egress = {r.name: r.egress_mbit for r in job.regions if r.egress_mbit is not None}
        return cls.full_mesh(
            sites,
            default=wan.default,
            overrides=links,
            faults=wan.faults,
            seed=job.seed,
            region_of=region_of,
            region_egress_mbit=egress,
        )


@dataclass(frozen=True)
class SharedLimits:
    """Rate limiters shared by several links: (egress, ingress) of each capped site's
    uplink and of each capped region's long-haul capacity."""

    sites: dict[str, tuple[TokenBucket, TokenBucket]]
    regions: dict[str, tuple[TokenBucket, TokenBucket]]
    region_of: dict[str, str]

    def on_the_way(self, src: str, dst: str) -> list[TokenBucket]:
        """Those that bytes from ``src`` to ``dst`` pass: src's uplink out, dst's in,
        and, between regions, src's region out and dst's region in."""
        out = []
        if src in self.sites:
            out.append(self.sites[src][0])
        if dst in self.sites:
            out.append(self.sites[dst][1])
        a, b = self.region_of.get(src), self.region_of.get(dst)
        if a != b:
            if a in self.regions:
                out.append(self.regions[a][0])
            if b in self.regions:
                out.append(self.regions[b][1])
        return out


def _pair(mbit: float) -> tuple[TokenBucket, TokenBucket]:
    rate = mbit * 1e6 / 8
    return TokenBucket(rate), TokenBucket(rate)


def direction_rng(seed: int, src: str, dst: str) -> random.Random:
    """The random stream of the direction src -> dst of a topology seeded ``seed``:
    reproducible, and independent of the other links (adding one changes no draws)."""
    return random.Random(zlib.crc32(f"{seed}:{src}->{dst}".encode()))
