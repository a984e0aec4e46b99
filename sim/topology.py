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
from dataclasses import dataclass

from isthmus.job.faults import Fault, validate_fault
from isthmus.job.link import LinkParams
from isthmus.job.model import Job, WanSpec
from isthmus.sim.token_bucket import TokenBucket


@dataclass(frozen=True, kw_only=True)
class Site:
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

    sites: tuple[Site, ...]
    links: dict[frozenset[str], tuple[tuple[str, str], LinkParams]]
    faults: tuple[Fault, ...] = ()
    seed: int = 0

    def site(self, name: str) -> Site:
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

    def uplink_buckets(self) -> dict[str, tuple[TokenBucket, TokenBucket]]:
        """For each site with an uplink cap: (egress, ingress) rate limiters, shared by
        every link of the site."""
        out = {}
        for site in self.sites:
            if site.uplink_mbit is not None:
                rate = site.uplink_mbit * 1e6 / 8
                out[site.name] = (TokenBucket(rate), TokenBucket(rate))
        return out

    def pairs(self) -> list[tuple[str, str]]:
        """Every link as (a, b) in a stable order."""
        return [pair for pair, _ in self.links.values()]

    @classmethod
    def full_mesh(
        cls,
        sites: list[Site],
        *,
        default: LinkParams,
        overrides: dict[frozenset[str], tuple[tuple[str, str], LinkParams]] | None = None,
        faults: list[Fault] | tuple[Fault, ...] = (),
        seed: int = 0,
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
        return cls(tuple(sites), links, tuple(faults), seed)

    @classmethod
    def for_job(cls, job: Job, listen: dict[str, list[tuple[str, int]]]) -> Topology:
        """The emulated topology of ``job``, with ``listen[site]`` the real address of
        each rank."""
        wan = job.wan or WanSpec(default=LinkParams())
        sites = [
            Site(name=s.name, listen=tuple(listen[s.name]), uplink_mbit=s.uplink_mbit)
            for s in job.sites
        ]
        return cls.full_mesh(
            sites, default=wan.default, overrides=wan.overrides, faults=wan.faults, seed=job.seed
        )


def direction_rng(seed: int, src: str, dst: str) -> random.Random:
    """The random stream of the direction src -> dst of a topology seeded ``seed``:
    reproducible, and independent of the other links (adding one changes no draws)."""
    return random.Random(zlib.crc32(f"{seed}:{src}->{dst}".encode()))
