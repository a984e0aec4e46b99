"""The alpha-beta cost of a cross-site all-reduce, per algorithm, on a given set of links.

Each pair of sites has a link (bandwidth, one-way latency); a site may also
have an uplink cap shared by all its links. For a tensor of N bytes over S
sites (``DESIGN.md``, "Performance model"):

* ``direct`` (reduce-scatter to slice owners, all-gather from them, full mesh):
  in each of two phases every site sends N/S to each other site at once, so a
  phase lasts as long as the slowest pair: its link's latency plus N/S at its
  bandwidth, or a site's latency plus (S-1)N/S through its uplink;
* ``ring`` (sorted order, chunk-pipelined): 2(S-1) steps of N/S on each ring
  link, each as long as the slowest hop (its latency plus N/S at its rate).

Latency and transfer add per link, then the slowest link sets the pace: on
uneven links the longest latency and the lowest bandwidth are often different
links (a 20 Mbit/s link at 40 ms beside a 300 Mbit/s one at 200 ms), and
adding the worst of each overstated a 3-site exchange by a third
(docs/performance-model.md, "Validation").

The collective engine uses this to choose an algorithm (``auto``); the
benchmarks use it for the bound they report efficiency against.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class LinkCost:
    """What a link costs: bytes per second, and seconds of one-way latency."""

    bandwidth_bytes_per_s: float
    one_way_s: float

    @classmethod
    def of(cls, *, bandwidth_mbit: float, rtt_ms: float) -> LinkCost:
        return cls(bandwidth_mbit * 1e6 / 8, rtt_ms / 2e3)


LinkLookup = Callable[[str, str], LinkCost]


def direct_seconds(
    nbytes: float,
    sites: Sequence[str],
    link: LinkLookup,
    uplink_bytes_per_s: Mapping[str, float] | None = None,
) -> float:
    s = len(sites)
    if s < 2:
        return 0.0
    uplinks = uplink_bytes_per_s or {}
    share = nbytes / s
    pairs = [(a, b, link(a, b)) for a in sites for b in sites if a != b]
    slowest = max(cost.one_way_s + share / cost.bandwidth_bytes_per_s for _, _, cost in pairs)
    capped = max(
        (
            (s - 1) * share / uplinks[x] + max(cost.one_way_s for a, _, cost in pairs if a == x)
            for x in sites
            if x in uplinks
        ),
        default=0.0,
    )
    return 2 * max(slowest, capped)


def ring_seconds(
    nbytes: float,
    sites: Sequence[str],
    link: LinkLookup,
    uplink_bytes_per_s: Mapping[str, float] | None = None,
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
    return 2 * (s - 1) * step


ALGORITHMS = {"direct": direct_seconds, "ring": ring_seconds}


def predict(
    nbytes: float,
    sites: Sequence[str],
    link: LinkLookup,
    uplink_bytes_per_s: Mapping[str, float] | None = None,
) -> dict[str, float]:
    """Predicted seconds of every algorithm."""
    return {
        name: cost(nbytes, sites, link, uplink_bytes_per_s) for name, cost in ALGORITHMS.items()
    }


def choose(
    nbytes: float,
    sites: Sequence[str],
    link: LinkLookup,
    uplink_bytes_per_s: Mapping[str, float] | None = None,
) -> str:
    """The algorithm with the smallest predicted time (direct on ties)."""
    predicted = predict(nbytes, sites, link, uplink_bytes_per_s)
    return min(predicted, key=lambda name: (predicted[name], name != "direct"))
