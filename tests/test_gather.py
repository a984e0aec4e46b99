"""The gather all-reduce over real gRPC: every site sends its whole contribution to every other.

Exact and weighted, identical everywhere, the direct algorithm's result with a
lossy codec, (S - 1) N on every uplink, nothing sent by a site left out, error
feedback, the sparse codec, and the cost model's choice between one trip and two.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from test_allreduce import _group, _inputs, _reference

from isthmus.inter.allreduce import RoundError
from isthmus.inter.codecs import parse_codec
from isthmus.sim.cost import LinkCost, choose, direct_seconds, gather_seconds


def _rounds(
    n_sites, n, codec="none", weights=None, rounds=1, feedback=None, only=None, algorithm="gather"
):
    """``rounds`` gather rounds of the same inputs; the outputs of each, and the last
    round's stats. ``only``: the sites that take part (the others stay out)."""

    async def main():
        names, members = await _group(n_sites, codec)
        taking = only or names
        w = weights or {s: 1.0 for s in taking}
        inputs = _inputs(taking, n)
        outs = []
        try:
            for r in range(rounds):
                got = await asyncio.gather(
                    *[
                        members[s].allreduce(
                            inputs[s],
                            round=r,
                            participants=taking,
                            weights=w,
                            algorithm=algorithm,
                            feedback=feedback,
                        )
                        for s in taking
                    ]
                )
                outs.append(dict(zip(taking, got, strict=True)))
            stats = {s: members[s].last for s in taking}
            chosen = {members[s].last_algorithm for s in taking}
        finally:
            for member in members.values():
                await member.close()
        assert chosen == {algorithm}
        return taking, inputs, w, outs, stats

    return asyncio.run(main())


@pytest.mark.parametrize("n_sites", [2, 3, 5])
@pytest.mark.parametrize("n", [0, 1, 7, 10_007])
def test_exact_weighted_average_identical_on_every_site(n_sites, n):
    weights = {f"site{i}": float(i + 1) for i in range(n_sites)}
    names, inputs, w, outs, _ = _rounds(n_sites, n, weights=weights)
    first = outs[0][names[0]]
    for name in names:
        assert torch.equal(outs[0][name], first), "sites disagree"
    if n:
        assert torch.allclose(first.double(), _reference(inputs, w), rtol=0, atol=1e-6)


@pytest.mark.parametrize("codec", ["bf16", "int8", "int4+zstd", "int2"])
def test_lossy_codecs_give_the_direct_algorithms_result_identical_everywhere(codec):
    """Each site encodes the average as direct's owners do: two encodes of error, and
    direct's values (the reduction's last bit may round apart: gather multiplies
    and adds where direct's owners fuse them)."""
    names, inputs, weights, outs, _ = _rounds(3, 20_000, codec=codec)
    c = parse_codec(codec)
    total = sum(weights.values())
    reference = _reference(inputs, weights)
    first_pass = sum(c.max_error(inputs[s]).double() * (weights[s] / total) for s in names)
    reduced_at_most = (reference.abs() + first_pass).float()
    bound = first_pass + c.max_error(reduced_at_most) * 1.01 + 1e-6
    result = outs[0][names[0]]
    for name in names:
        assert torch.equal(outs[0][name], result)
    assert torch.all((result.double() - reference).abs() <= bound)
    direct = _rounds(3, 20_000, codec=codec, algorithm="direct")[3][0][names[0]].double()
    apart = (result.double() - direct).abs()
    # Where a sum's last bit rounded apart: a block's scale an ulp apart, and at a
    # rounding boundary a value one quantisation step (twice max_error) apart.
    assert (apart > 1e-5 * (1 + direct.abs())).float().mean() < 0.01
    assert torch.all(apart <= 2 * c.max_error(reduced_at_most).double() * 1.01 + 1e-6)


def test_every_site_sends_its_whole_vector_to_every_other_site():
    n_sites, n = 3, 30_000
    names, _, _, _, stats = _rounds(n_sites, n)
    for name in names:
        assert stats[name].bytes_sent == (n_sites - 1) * n * 4


def test_a_site_of_weight_zero_sends_nothing_and_gets_the_average():
    weights = {"site0": 2.0, "site1": 0.0, "site2": 1.0}
    names, inputs, w, outs, stats = _rounds(3, 5000, codec="int8", weights=weights)
    assert stats["site1"].bytes_sent == 0
    for name in names:
        assert torch.equal(outs[0][name], outs[0]["site0"])
    reference = _reference(inputs, w)
    assert torch.allclose(outs[0]["site1"].double(), reference, atol=0.05)


def test_only_the_participants_take_part():
    names, inputs, w, outs, _ = _rounds(4, 1000, only=["site0", "site2", "site3"])
    assert names == ["site0", "site2", "site3"]
    assert torch.allclose(outs[0]["site3"].double(), _reference(inputs, w), atol=1e-6)


def test_error_feedback_carries_what_the_codec_lost_into_the_next_round():
    def mean_error(feedback):
        names, inputs, w, outs, _ = _rounds(3, 20_000, codec="int4", rounds=20, feedback=feedback)
        mean = sum(o[names[0]].double() for o in outs) / len(outs)
        return (mean - _reference(inputs, w)).abs().mean().item()

    without, with_feedback = mean_error(None), mean_error("model")
    assert with_feedback < 0.5 * without, (with_feedback, without)


def test_topk_carries_the_union_of_the_sites_positions_as_direct_does():
    spec, n_sites, n = "topk:chunk=256,density=0.05", 3, 30_000
    names, _, _, outs, stats = _rounds(n_sites, n, codec=spec)
    codec = parse_codec(spec)
    result = outs[0][names[0]]
    for name in names:
        assert torch.equal(outs[0][name], result), "sites disagree"
    nonzero = int((result != 0).sum())
    assert codec.sparse.per_chunk * n / 256 < nonzero
    # Each slice's last chunk may be partial (direct's chunks): 2 S chunks more at most.
    assert nonzero <= n_sites * codec.sparse.per_chunk * (n / 256 + 2 * n_sites)
    # Up: the whole sparse vector to each other site; nothing comes back from an owner.
    for name in names:
        per_site = n * codec.bytes_per_value()
        assert stats[name].bytes_sent == pytest.approx((n_sites - 1) * per_site, rel=0.05)


def test_a_silent_participant_fails_the_round_naming_it():
    async def main():
        names, members = await _group(3, deadline_s=1.0)
        try:
            # site2 never joins the round.
            results = await asyncio.gather(
                *[
                    members[s].allreduce(
                        torch.ones(100),
                        round=0,
                        participants=names,
                        weights={s: 1.0 for s in names},
                        algorithm="gather",
                    )
                    for s in names[:2]
                ],
                return_exceptions=True,
            )
        finally:
            for member in members.values():
                await member.close()
        return results

    for error in asyncio.run(main()):
        assert isinstance(error, RoundError)
        assert error.site == "site2" and "did not deliver" in str(error)


def test_cost_of_gather_is_one_trip_with_the_whole_vector():
    sites = ["a", "b", "c"]
    link = lambda a, b: LinkCost.of(bandwidth_mbit=200, rtt_ms=50)  # noqa: E731
    n = 4e6
    assert gather_seconds(n, sites, link) == pytest.approx(0.025 + n / 25e6)
    caps = {s: 10e6 for s in sites}
    assert gather_seconds(n, sites, link, caps) == pytest.approx(0.025 + 2 * n / 10e6)
    assert gather_seconds(n, ["a"], link) == 0.0


@pytest.mark.parametrize(("nbytes", "expected"), [(50e3, "gather"), (50e6, "direct")])
def test_long_links_small_payloads_choose_gather_large_ones_direct(nbytes, expected):
    sites = ["us", "eu", "asia"]
    link = lambda a, b: LinkCost.of(bandwidth_mbit=100, rtt_ms=230)  # noqa: E731
    assert choose(nbytes, sites, link) == expected
    cheaper = min(direct_seconds(nbytes, sites, link), gather_seconds(nbytes, sites, link))
    assert cheaper == (gather_seconds if expected == "gather" else direct_seconds)(
        nbytes, sites, link
    )


def test_auto_chooses_by_the_encoded_bytes_not_float32():
    """A 2-bit round moves a sixteenth of float32's bytes: on long links the engine's
    auto takes one trip for it, where float32 of the same length takes two."""

    async def main():
        names, members = await _group(3)
        slow = lambda a, b: LinkCost.of(bandwidth_mbit=100, rtt_ms=230)  # noqa: E731
        member = members["site0"]
        member.link_costs = slow
        values = torch.empty(5_000_000)  # 20 MB as float32: two trips; 1.3 MB as int2: one
        try:
            as_float = member._pick_algorithm("auto", values, names)
            as_int2 = member._pick_algorithm("auto", values, names, parse_codec("int2"))
            topk = member._pick_algorithm("auto", values, names, parse_codec("topk"))
        finally:
            for m in members.values():
                await m.close()
        return as_float, as_int2, topk

    assert asyncio.run(main()) == ("direct", "gather", "gather")


def test_auto_prices_the_union_of_the_contributing_sites_only():
    """Direct's owners send back the union of the positions the sites sent; a site of
    weight 0 sends none, so with one contributor the union is one contribution and
    direct moves no more than gather, where three contributors' union made it slower."""

    async def main():
        names, members = await _group(3)
        member = members["site0"]
        member.link_costs = lambda a, b: LinkCost.of(bandwidth_mbit=100, rtt_ms=10)
        values = torch.empty(10_000_000)
        topk = parse_codec("topk")
        everyone = {s: 1.0 for s in names}
        alone = {s: float(s == "site0") for s in names}
        try:
            picks = [
                member._pick_algorithm("auto", values, names, topk, weights)
                for weights in (everyone, alone)
            ]
        finally:
            for m in members.values():
                await m.close()
        return picks

    assert asyncio.run(main()) == ["gather", "direct"]


def test_auto_weighs_the_uplink_caps_and_what_gather_must_hold(monkeypatch):
    """Gather pushes (S - 1) N through each uplink and holds S - 1 contributions: a
    capped uplink, or a round too large to hold, leaves the round to direct."""
    from isthmus.inter.allreduce import engine as engine_module

    async def main():
        names, members = await _group(3)
        member = members["site0"]
        member.link_costs = lambda a, b: LinkCost.of(bandwidth_mbit=1000, rtt_ms=100)
        values = torch.empty(2_500_000)  # 10 MB of float32
        try:
            free = member._pick_algorithm("auto", values, names)
            member.uplink_bytes_per_s = {s: 100e6 / 8 for s in names}
            capped = member._pick_algorithm("auto", values, names)
            member.uplink_bytes_per_s = {}
            monkeypatch.setattr(engine_module, "AUTO_GATHER_MAX_HELD_BYTES", 10_000_000)
            too_large = member._pick_algorithm("auto", values, names)
            explicit = member._pick_algorithm("gather", values, names)
        finally:
            for m in members.values():
                await m.close()
        return free, capped, too_large, explicit

    assert asyncio.run(main()) == ("gather", "direct", "direct", "gather")


def test_an_emulated_jobs_uplink_caps_reach_the_cost_model_per_lane():
    from isthmus.job.file import parse_job
    from isthmus.sim.cost import job_uplinks

    text = (
        "name: x\nsites:\n  - {name: a, uplink_mbit: 80}\n  - {name: b}\n"
        "wan: {default: {rtt_ms: 50}}\n"
    )
    assert job_uplinks(parse_job(text)) == {"a": 10e6}
    assert job_uplinks(parse_job(text), lanes=2) == {"a": 5e6}
    real = "name: x\nsites:\n  - {name: a, uplink_mbit: 80}\n  - {name: b}\n"
    assert job_uplinks(parse_job(real)) == {}
