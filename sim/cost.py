"""The alpha-beta cost of a cross-site all-reduce, per algorithm, on a given set of links.

Each pair of sites has a link (bandwidth, one-way latency); a site may also
have an uplink cap shared by all its links. For a tensor of N bytes over S
sites (``DESIGN.md``, "Performance model"):

* ``direct`` (reduce-scatter to slice owners, all-gather from them, full mesh):
  in each of two phases every site sends N/S to each other site at once, so a
  phase lasts as long as the slowest pair: its link's latency plus N/S at its
  bandwidth, or a site's latency plus (S-1)N/S through its uplink;
* ``gather`` (every site sends all N to every other site, full mesh, and each
  reduces them itself): one phase as long as the slowest pair, its latency plus
  N at its bandwidth, or a site's latency plus (S-1)N through its uplink. One
  trip instead of direct's two, for (S-1)N sent instead of 2(S-1)N/S: the
  faster on long links with small payloads;
* ``ring`` (sorted order, chunk-pipelined): 2(S-1) steps of N/S on each ring
  link, each as long as the slowest hop (its latency plus N/S at its rate).
* ``two_level`` (with regions): direct inside each region, direct across
  regions between counterparts on the region's average, then each member's
  slices to the rest of its region (float32); see
  :mod:`isthmus.inter.allreduce.two_level`.

With regions whose long-haul capacity is shared (``region_egress``, bytes per
second each way), everything a region's sites send to other regions in a phase
passes it: direct pushes ``m (S - m) N / S`` through a region of m sites,
two-level ``(K - 1) N / K`` (K regions), the ring N/S per hop that leaves the
region.

Where every site runs on one machine (an emulated job), that machine also moves
every byte: each phase lasts at least the bytes all sites send in it over the
machine's measured data-plane rate (``machine_bytes_per_s``; unbounded for real
sites). Direct sends ``(S - 1) N`` in each phase, the ring ``N`` per step,
two-level ``sum (m - 1) N`` inside the regions at each end and ``(K - 1) N`` in
each half of the exchange across.

Latency and transfer add per link, then the slowest link sets the pace: on
uneven links the longest latency and the lowest bandwidth are often different
links (a 20 Mbit/s link at 40 ms beside a 300 Mbit/s one at 200 ms), and
adding the worst of each overstated a 3-site exchange by a third
(docs/performance-model.md, "Validation").

The collective engine uses this to choose an algorithm (``auto``); the
benchmarks use it for the bound they report efficiency against.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from isthmus.job.model import Job

UNCAPPED_BYTES_PER_S = 100e9 / 8
"""What the cost model takes for a link with no rate cap."""

TWO_LEVEL_MAX_PARTS = 4
"""Most parts the two-level algorithm reduces a region's slices in, each going
across as soon as it is reduced (:mod:`isthmus.inter.allreduce.two_level`)."""
TWO_LEVEL_MIN_PART_BYTES = 2 << 20
"""Least bytes of a part: below it a part's own round trip inside the region would
cost more than the overlap gains (a small tensor is one part)."""


def two_level_parts(nbytes: float, largest_region: int) -> int:
    """How many parts the two-level algorithm cuts phase 1 into for ``nbytes`` (of
    float32 values, in the engine) with regions of at most ``largest_region`` sites:
    every site computes the same, since the wire's shard numbers depend on it."""
    slice_bytes = nbytes / max(1, largest_region)
    return max(1, min(TWO_LEVEL_MAX_PARTS, int(slice_bytes // TWO_LEVEL_MIN_PART_BYTES)))


@dataclass(frozen=True)
class LinkCost:
    """What a link costs: bytes per second, and seconds of one-way latency."""

    bandwidth_bytes_per_s: float
    one_way_s: float

    @classmethod
    def of(cls, *, bandwidth_mbit: float, rtt_ms: float) -> LinkCost:
        return cls(bandwidth_mbit * 1e6 / 8, rtt_ms / 2e3)


LinkLookup = Callable[[str, str], LinkCost]


@dataclass(frozen=True)
class Regions:
    """Which region each site is in, and each capped region's shared long-haul
    capacity (bytes per second, each way)."""

    of: Mapping[str, str]
    egress_bytes_per_s: Mapping[str, float]

    def groups(self, sites: Sequence[str]) -> dict[str, list[str]]:
        """The sites of each region, sorted (a site in no region is its own)."""
        out: dict[str, list[str]] = {}
        for site in sorted(sites):
            out.setdefault(self.of.get(site, f"site:{site}"), []).append(site)
        return out

    def egress_seconds(
        self, sites: Sequence[str], leaving: Callable[[list[str]], float], link: LinkLookup
    ) -> float:
        """The slowest capped region: ``leaving(members)`` bytes through its long-haul,
        plus the longest latency of a link out of it."""
        worst = 0.0
        groups = self.groups(sites)
        for region, members in groups.items():
            rate = self.egress_bytes_per_s.get(region)
            inside = set(members)
            outside = [s for s in sites if s not in inside]
            if rate is None or not outside:
                continue
            latency = max(link(a, b).one_way_s for a in members for b in outside)
            worst = max(worst, leaving(members) / rate + latency)
        return worst


def _mesh_phase(
    pair_bytes: float,
    sites: Sequence[str],
    link: LinkLookup,
    uplinks: Mapping[str, float],
) -> float:
    """One phase of a full mesh in which every site sends ``pair_bytes`` to every other
    at once: the slowest pair (its latency plus its transfer), or the slowest capped
    uplink ((S - 1) times that through it, plus the site's longest latency)."""
    slowest = 0.0
    farthest: dict[str, float] = {}  # each site's longest one-way latency
    for a in sites:
        for b in sites:
            if a != b:
                cost = link(a, b)
                slowest = max(slowest, cost.one_way_s + pair_bytes / cost.bandwidth_bytes_per_s)
                farthest[a] = max(farthest.get(a, 0.0), cost.one_way_s)
    capped = max(
        ((len(sites) - 1) * pair_bytes / uplinks[x] + farthest[x] for x in sites if x in uplinks),
        default=0.0,
    )
    return max(slowest, capped)


def _mesh_seconds(
    pair_bytes: float,
    phases: int,
    sites: Sequence[str],
    link: LinkLookup,
    uplink_bytes_per_s: Mapping[str, float] | None,
    regions: Regions | None,
    machine_bytes_per_s: float,
) -> float:
    """``phases`` full-mesh phases, each site sending ``pair_bytes`` to every other
    at once: each as long as its slowest pair or capped uplink, the long-haul of a
    capped region (m (S - m) pairs leave a region of m), or the machine that moves
    every pair's bytes (S (S - 1) of them) where one runs every site."""
    s = len(sites)
    if s < 2:
        return 0.0
    phase = _mesh_phase(pair_bytes, sites, link, uplink_bytes_per_s or {})
    shared = 0.0
    if regions is not None:
        shared = regions.egress_seconds(sites, lambda m: len(m) * (s - len(m)) * pair_bytes, link)
    return phases * max(phase, shared, s * (s - 1) * pair_bytes / machine_bytes_per_s)


def direct_seconds(
    nbytes: float,
    sites: Sequence[str],
    link: LinkLookup,
    uplink_bytes_per_s: Mapping[str, float] | None = None,
    regions: Regions | None = None,
    machine_bytes_per_s: float = math.inf,
) -> float:
    """Two phases of N/S per pair: the reduce-scatter, then the owners' results."""
    share = nbytes / max(1, len(sites))
    return _mesh_seconds(share, 2, sites, link, uplink_bytes_per_s, regions, machine_bytes_per_s)


def gather_seconds(
    nbytes: float,
    sites: Sequence[str],
    link: LinkLookup,
    uplink_bytes_per_s: Mapping[str, float] | None = None,
    regions: Regions | None = None,
    machine_bytes_per_s: float = math.inf,
) -> float:
    """One phase of all N per pair: every contribution to every site."""
    return _mesh_seconds(nbytes, 1, sites, link, uplink_bytes_per_s, regions, machine_bytes_per_s)


def ring_seconds(
    nbytes: float,
    sites: Sequence[str],
    link: LinkLookup,
    uplink_bytes_per_s: Mapping[str, float] | None = None,
    regions: Regions | None = None,
    machine_bytes_per_s: float = math.inf,
) -> float:
    s = len(sites)
    if s < 2:
        return 0.0
    uplinks = uplink_bytes_per_s or {}
    order = sorted(sites)
    hops = [(order[k], order[(k + 1) % s]) for k in range(s)]
    share = nbytes / s
    step = 0.0
    for a, b in hops:
        rate = min(link(a, b).bandwidth_bytes_per_s, uplinks.get(a, float("inf")))
        step = max(step, link(a, b).one_way_s + share / rate)
    if regions is not None:
        hops_out = lambda m: sum(1 for a, b in hops if a in m and b not in m) * share  # noqa: E731
        step = max(step, regions.egress_seconds(sites, hops_out, link))
    step = max(step, nbytes / machine_bytes_per_s)  # every site sends N / S a step
    return 2 * (s - 1) * step


def two_level_seconds(
    nbytes: float,
    sites: Sequence[str],
    link: LinkLookup,
    uplink_bytes_per_s: Mapping[str, float] | None = None,
    regions: Regions | None = None,
    machine_bytes_per_s: float = math.inf,
) -> float:
    """A reduce-scatter inside every region (at once), direct across regions among
    each piece's holders (the busiest holding the largest slice, N / the smallest
    region's size), then each member's slice to the rest of its region. The first
    two are a pipeline of K parts (:func:`two_level_parts`): each part goes across
    once it is reduced, while the next is reduced."""
    if regions is None or len(sites) < 2:
        return direct_seconds(nbytes, sites, link, uplink_bytes_per_s, regions, machine_bytes_per_s)
    groups = regions.groups(sites)
    # Inside every region at once, each member sends (m - 1) N / m: on one machine
    # the regions' phases share it.
    inside_bytes = sum(len(m) - 1 for m in groups.values()) * nbytes
    # The reduce-scatter is the direct algorithm's first of two equal phases.
    inside = max(direct_seconds(nbytes, m, link, uplink_bytes_per_s) for m in groups.values()) / 2
    inside = max(inside, inside_bytes / machine_bytes_per_s)
    k, q = len(groups), max(len(m) for m in groups.values())
    across = 0.0
    if k > 1:
        busiest = nbytes / min(len(m) for m in groups.values())
        for j in range(q):  # holders of the pieces (exact for regions of equal size)
            group = [m[j * len(m) // q] for m in groups.values()]
            across = max(across, direct_seconds(busiest, group, link, uplink_bytes_per_s))
        shared = regions.egress_seconds(sites, lambda m: (k - 1) * nbytes / k, link)
        # Each piece's k holders run the direct algorithm on it: (k - 1) N in all per half.
        across = max(across, 2 * shared, 2 * (k - 1) * nbytes / machine_bytes_per_s)
    back = 0.0
    for members in groups.values():
        if len(members) < 2:
            continue
        part = nbytes / len(members)
        back = max(
            back,
            max(link(a, b).one_way_s + part / link(a, b).bandwidth_bytes_per_s
                for a in members for b in members if a != b),
        )  # fmt: skip
    back = max(back, inside_bytes / machine_bytes_per_s)
    # Two stages of K equal parts: the slower stage's K parts, plus one of the other's.
    k = two_level_parts(nbytes, q)
    first, second = inside / k, across / k
    return first + second + (k - 1) * max(first, second) + back


ALGORITHMS = {"direct": direct_seconds, "gather": gather_seconds, "ring": ring_seconds}
"""Those every job can use; ``two_level`` joins them where the sites have regions."""
ALGORITHM_COSTS: dict[str, Callable[..., float]] = {**ALGORITHMS, "two_level": two_level_seconds}
"""Every algorithm's cost by name (two-level without regions costs as direct)."""
LOSSY_ALGORITHMS = ("direct", "gather", "two_level")
"""Those a round with a lossy codec takes (the engine's ``auto``, the performance
model): the ring re-encodes partial sums at every hop and cannot carry error
feedback, which costs more loss than its time saves."""


def sent_share(algorithm: str, sites: int) -> float:
    """How many times the vector's bytes each site sends in one all-reduce: the whole
    vector to every other site with ``gather``, 2 (S - 1) / S with the others (two
    levels: about that, counted as that)."""
    if sites < 2:
        return 0.0
    return sites - 1.0 if algorithm == "gather" else 2 * (sites - 1) / sites


def codec_work(algorithm: str, sites: int) -> float:
    """A site's codec work in one all-reduce, relative to the direct algorithm's (what
    the performance model's codec speed was calibrated on), counted in encodes and
    decodes of the whole vector. Direct: its contribution encoded, its slice of the
    result encoded, the others' contributions to its slice and the whole result
    decoded, 3 in all. Gather: its contribution and the result encoded, the S - 1
    other contributions and the result decoded, S + 2."""
    if algorithm != "gather" or sites < 2:
        return 1.0
    return (sites + 2) / 3


def predict(
    nbytes: float,
    sites: Sequence[str],
    link: LinkLookup,
    uplink_bytes_per_s: Mapping[str, float] | None = None,
    *,
    regions: Regions | None = None,
    machine_bytes_per_s: float = math.inf,
) -> dict[str, float]:
    """Predicted seconds of every algorithm (``two_level`` too, given ``regions``
    that group some sites together); ``machine_bytes_per_s``: the data-plane rate of
    one machine that runs every site (an emulated job)."""
    algorithms: dict[str, Callable[..., float]] = dict(ALGORITHMS)
    if regions is not None and any(len(m) > 1 for m in regions.groups(sites).values()):
        algorithms["two_level"] = two_level_seconds
    return {
        name: cost(nbytes, sites, link, uplink_bytes_per_s, regions, machine_bytes_per_s)
        for name, cost in algorithms.items()
    }


def choose(
    nbytes: float,
    sites: Sequence[str],
    link: LinkLookup,
    uplink_bytes_per_s: Mapping[str, float] | None = None,
    *,
    regions: Mapping[str, str] | None = None,
    region_egress_bytes_per_s: Mapping[str, float] | None = None,
    among: Sequence[str] | None = None,
    result_nbytes: float | None = None,
) -> str:
    """The algorithm with the smallest predicted time (direct on ties), ``among``
    those named (default: every one the sites can use). ``result_nbytes``: the
    encoded size of the average where it differs from a contribution's (the
    sparse codec's union of the sites' positions): direct's second phase carries
    that, its first ``nbytes``; gather sends contributions only."""
    grouped = None if not regions else Regions(regions, dict(region_egress_bytes_per_s or {}))
    predicted = predict(nbytes, sites, link, uplink_bytes_per_s, regions=grouped)
    if result_nbytes is not None and "direct" in predicted:
        # Two phases of N/S each: their mean size costs what the pair of them does.
        predicted["direct"] = direct_seconds(
            (nbytes + result_nbytes) / 2, sites, link, uplink_bytes_per_s, grouped
        )
    if among is not None:
        predicted = {name: t for name, t in predicted.items() if name in among}
    return min(predicted, key=lambda name: (predicted[name], name != "direct"))


def job_uplinks(job: Job, lanes: int = 1) -> dict[str, float]:
    """The emulated sites' uplink caps (``uplink_mbit``), bytes per second, each lane's
    share of it where a site's ranks split the vector into ``lanes`` (all of them
    cross at once); empty for a job on a real WAN, which states none."""
    if job.wan is None:
        return {}
    return {s.name: s.uplink_mbit * 1e6 / 8 / lanes for s in job.sites if s.uplink_mbit}


def job_costs(job: Job) -> tuple[LinkLookup | None, Regions | None]:
    """What the cost model knows of a job: its emulated links (each a -> b: its rate,
    100 Gbit/s where it has none, and one-way delay; None for a job on a real WAN,
    which states none) and its regions with their shared long-haul capacity."""
    region_of = job.region_of()
    regions = None
    if region_of:
        egress = {r.name: r.egress_mbit * 1e6 / 8 for r in job.regions if r.egress_mbit}
        regions = Regions(region_of, egress)
    wan = job.wan
    if wan is None:
        return None, regions

    def cost(a: str, b: str) -> LinkCost:
        direction = wan.link_between(a, b, region_of).a_to_b
        rate = direction.rate_bytes_per_s or UNCAPPED_BYTES_PER_S
        return LinkCost(rate, direction.delay_ms / 1e3)

    return cost, regions
