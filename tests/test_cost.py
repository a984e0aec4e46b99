"""The alpha-beta cost model against hand-computed cases, and the choice it makes."""

import pytest

from isthmus.sim.cost import LinkCost, choose, direct_seconds, predict, ring_seconds

MB = 1e6


def uniform(bandwidth_mbit, rtt_ms):
    cost = LinkCost.of(bandwidth_mbit=bandwidth_mbit, rtt_ms=rtt_ms)
    return lambda a, b: cost


def test_direct_and_ring_on_a_full_mesh_match_the_design_formulas():
    sites = ["a", "b", "c"]
    n = 64 * 2**20
    link = uniform(200, 50)  # 25 MB/s, 25 ms one way
    assert direct_seconds(n, sites, link) == pytest.approx(2 * n / (3 * 25 * MB) + 2 * 0.025)
    assert ring_seconds(n, sites, link) == pytest.approx(2 * 2 / 3 * n / (25 * MB) + 2 * 2 * 0.025)


def test_an_uplink_cap_bounds_both_algorithms_alike():
    sites = ["a", "b", "c", "d"]
    n = 100 * MB
    link = uniform(10_000, 0)
    caps = {s: 10 * MB for s in sites}
    # Every site must send 2 (S-1)/S N through its uplink, whatever the algorithm.
    expected = 2 * 3 / 4 * n / (10 * MB)
    assert direct_seconds(n, sites, link, caps) == pytest.approx(expected)
    assert ring_seconds(n, sites, link, caps) == pytest.approx(expected)


def test_direct_wins_on_a_uniform_mesh_and_ring_avoids_a_slow_diagonal():
    sites = ["a", "b", "c", "d"]
    n = 64 * 2**20
    assert choose(n, sites, uniform(200, 50)) == "direct"

    def slow_diagonal(x, y):
        # The ring (a-b-c-d-a) never uses a<->c; the full mesh must.
        if {x, y} == {"a", "c"}:
            return LinkCost.of(bandwidth_mbit=5, rtt_ms=50)
        return LinkCost.of(bandwidth_mbit=1000, rtt_ms=10)

    predicted = predict(n, sites, slow_diagonal)
    assert predicted["ring"] < predicted["direct"]
    assert choose(n, sites, slow_diagonal) == "ring"


def test_one_site_costs_nothing():
    assert direct_seconds(1e9, ["a"], uniform(1, 1)) == 0.0
    assert ring_seconds(1e9, ["a"], uniform(1, 1)) == 0.0


def test_on_uneven_links_latency_and_transfer_add_per_link_then_the_slowest_sets_the_pace():
    """A slow link at a short RTT beside a fast one at a long RTT (a held-out
    validation job's): each phase lasts as long as its slowest pair, latency plus
    transfer on the same link, not the largest latency plus the lowest bandwidth."""
    sites = ["a", "b", "c"]
    n = 3 * MB  # 1 MB a pair per phase

    def uneven(x, y):
        if {x, y} == {"a", "b"}:
            return LinkCost.of(bandwidth_mbit=8, rtt_ms=40)  # 1 s per MB, 20 ms one way
        return LinkCost.of(bandwidth_mbit=800, rtt_ms=400)  # 0.01 s per MB, 200 ms one way

    assert direct_seconds(n, sites, uneven) == pytest.approx(2 * (1.0 + 0.02))
    # The ring's every step waits for its slowest hop (a-b, b-c, c-a), likewise.
    assert ring_seconds(n, sites, uneven) == pytest.approx(2 * 2 * (1.0 + 0.02))
