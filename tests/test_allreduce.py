"""The direct cross-site all-reduce over real gRPC: exact, weighted, identical everywhere, bounded."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest
import torch

from isthmus.inter.allreduce import CrossSiteAllReduce, RoundError, slice_bounds
from isthmus.inter.chunks import encode_chunks
from isthmus.inter.codecs import parse_codec
from isthmus.inter.peer import Identity
from isthmus.inter.peer_client import PeerClient
from isthmus.inter.transport import TransportSettings, connections_for

JOB = "allreduce-test"


async def _group(
    n_sites: int, codec: str = "none", deadline_s: float = 30.0, filter_for=None, settings=None
):
    """Connected engines ``site0`` ... ; ``filter_for(name)``: each one's chunk filter."""
    names = [f"site{i}" for i in range(n_sites)]
    members = {}
    ports = {}
    for name in names:
        identity = Identity(job=JOB, site=name, rank=0, layout_fingerprint="L")
        # Peers are filled in once every server has its port.
        member = CrossSiteAllReduce(
            identity,
            {},
            codec=parse_codec(codec),
            deadline_s=deadline_s,
            chunk_filter=None if filter_for is None else filter_for(name),
            settings=settings,
        )
        ports[name] = await member.start("127.0.0.1", 0)
        members[name] = member
    for name, member in members.items():
        member.peers = {o: f"127.0.0.1:{ports[o]}" for o in names if o != name}
        member.server.servicer.sites = set(names)
    for member in members.values():
        await member.connect()
    return names, members


async def _close(members):
    for member in members.values():
        await member.close()


def _inputs(names, n, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return {name: torch.randn(n, generator=generator) * (i + 1) for i, name in enumerate(names)}


def _reference(inputs, weights):
    total = sum(weights.values())
    return sum(inputs[s].double() * (weights[s] / total) for s in inputs)


def _run(n_sites, n, codec="none", weights=None, round=0):
    async def main():
        names, members = await _group(n_sites, codec)
        w = weights or {s: 1.0 for s in names}
        inputs = _inputs(names, n)
        try:
            outs = await asyncio.gather(
                *[
                    members[s].allreduce(inputs[s], round=round, participants=names, weights=w)
                    for s in names
                ]
            )
            stats = {s: members[s].last for s in names}
        finally:
            await _close(members)
        return names, inputs, w, dict(zip(names, outs, strict=True)), stats

    return asyncio.run(main())


@pytest.mark.parametrize("n_sites", [2, 3, 5])
@pytest.mark.parametrize("n", [0, 1, 7, 10_007])
def test_exact_average_identical_on_every_site(n_sites, n):
    names, inputs, weights, outs, _ = _run(n_sites, n)
    reference = _reference(inputs, weights) if n else torch.zeros(0, dtype=torch.float64)
    first = outs[names[0]]
    for name in names:
        assert torch.equal(outs[name], first), "sites disagree"
    if n:
        assert torch.allclose(first.double(), reference, rtol=0, atol=1e-6)


def test_weights_by_tokens_seen():
    weights = {"site0": 1000.0, "site1": 3000.0, "site2": 500.0}
    _, inputs, w, outs, _ = _run(3, 1001, weights=weights)
    assert torch.allclose(outs["site0"].double(), _reference(inputs, w), atol=1e-6)


@pytest.mark.parametrize("codec", ["bf16", "int8", "int4+zstd", "int2"])
def test_lossy_codecs_stay_within_two_encodes_and_identical(codec):
    names, inputs, weights, outs, _ = _run(3, 20_000, codec=codec)
    reference = _reference(inputs, weights)
    c = parse_codec(codec)
    # Each contribution is encoded once, the owner's average once more. The second
    # encode's step follows the block absmax of what the owner reduced, which the
    # first encode's error can raise above the exact average's (by up to half of
    # it with int2): bound that absmax by |exact| + first-pass error.
    total = sum(weights.values())
    first_pass = sum(c.max_error(inputs[s]) * (weights[s] / total) for s in names)
    reduced_at_most = (reference.abs() + first_pass).float()
    bound = first_pass + c.max_error(reduced_at_most) * 1.01 + 1e-6
    for name in names:
        assert torch.equal(outs[name], outs[names[0]])
    assert torch.all((outs[names[0]].double() - reference).abs() <= bound)


def test_bytes_moved_match_the_direct_algorithm():
    n_sites, n = 3, 30_000
    names, _, _, _, stats = _run(n_sites, n)
    # Direct: each site sends (S-1)/S of its tensor in each of two phases.
    expected = 2 * (n_sites - 1) / n_sites * n * 4
    for name in names:
        assert abs(stats[name].bytes_sent - expected) <= 0.02 * expected


def test_on_every_link_the_contributions_go_before_the_results():
    """A result queued ahead of a contribution on a link would hold back the owner
    waiting for that contribution; the link carries the same bytes either way."""
    n_sites, n = 3, 30_000

    async def main():
        handed = {f"site{i}": [] for i in range(n_sites)}

        def recording(name):
            def record(site, chunk):
                handed[name].append((site, chunk.shard))
                return chunk

            return record

        names, members = await _group(n_sites, filter_for=recording)
        for member in members.values():
            member.settings = TransportSettings(max_chunk_bytes=4096)  # ~10 chunks a slice
        inputs = _inputs(names, n)
        weights = {s: 1.0 for s in names}
        try:
            outs = await asyncio.gather(
                *[
                    members[s].allreduce(inputs[s], round=0, participants=names, weights=weights)
                    for s in names
                ]
            )
        finally:
            await _close(members)
        return names, inputs, weights, outs, handed

    names, inputs, weights, outs, handed = asyncio.run(main())
    expected = _reference(inputs, weights)
    for out in outs:
        assert torch.equal(out, outs[0])
        assert (out.double() - expected).abs().max() < 1e-6
    for sender, log in handed.items():
        for peer in names:
            if peer == sender:
                continue
            phases = [shard >= n_sites for site, shard in log if site == peer]
            assert phases.count(False) > 1 and phases.count(True) > 1, (sender, peer, phases)
            # Every contribution (shard < S) was handed to gRPC before the first result.
            assert phases == sorted(phases), (sender, peer, phases)


def test_a_nan_contribution_from_a_peer_is_refused_naming_the_site():
    async def main():
        names, members = await _group(2, deadline_s=5)
        codec = members["site1"].codec
        try:
            bad = torch.ones(5)
            bad[2] = float("nan")
            w = {s: 1.0 for s in names}
            # A peer that sends NaN anyway (a bug, or a hostile peer): site1 bypasses
            # its own check and sends slice 0 straight to its owner, site0.
            owner = members["site0"].allreduce(
                torch.ones(10), round=0, participants=names, weights=w
            )
            chunks = encode_chunks(codec, bad, round=0, shard=0, max_chunk_bytes=1 << 20)
            sneak = members["site1"].outgoing.send("site0", chunks, round=0, deadline_s=5)
            results = await asyncio.gather(owner, sneak, return_exceptions=True)
        finally:
            await _close(members)
        return results

    owner_result, _ = asyncio.run(main())
    assert isinstance(owner_result, RoundError) and owner_result.site == "site1"
    assert "site 'site1' sent 1 NaN/Inf values; refused" in str(owner_result)


def test_a_nan_in_this_sites_own_tensor_is_never_sent():
    async def main():
        names, members = await _group(2, deadline_s=5)
        try:
            bad = torch.ones(10)
            bad[7] = float("inf")
            with pytest.raises(RoundError, match="own tensor holds 1 NaN/Inf values; not sent"):
                await members["site1"].allreduce(
                    bad, round=0, participants=names, weights={s: 1.0 for s in names}
                )
        finally:
            await _close(members)

    asyncio.run(main())


def test_a_silent_participant_fails_the_round_by_its_deadline():
    async def main():
        names, members = await _group(3, deadline_s=2)
        try:
            w = {s: 1.0 for s in names}
            # site2 never calls allreduce: the others must not wait forever.
            results = await asyncio.gather(
                *[
                    members[s].allreduce(torch.ones(99), round=0, participants=names, weights=w)
                    for s in ("site0", "site1")
                ],
                return_exceptions=True,
            )
        finally:
            await _close(members)
        return results

    results = asyncio.run(main())
    assert all(isinstance(r, RoundError) for r in results)
    assert any(r.site == "site2" and "did not deliver within 2 s" in str(r) for r in results)


def test_slices_cover_everything_evenly():
    for count in (0, 1, 5, 1000, 1001):
        for parts in (1, 2, 3, 6):
            bounds = slice_bounds(count, parts)
            assert bounds[0][0] == 0 and bounds[-1][1] == count
            sizes = [b - a for a, b in bounds]
            assert max(sizes) - min(sizes) <= 1


def test_after_a_failed_round_the_survivors_go_on_without_the_lost_site():
    async def main():
        names, members = await _group(3, deadline_s=2)
        try:
            w = {s: 1.0 for s in names}
            failed = await asyncio.gather(
                *[
                    members[s].allreduce(torch.ones(50), round=0, participants=names, weights=w)
                    for s in ("site0", "site1")
                ],
                return_exceptions=True,
            )
            survivors = ["site0", "site1"]
            x = {"site0": torch.full((50,), 2.0), "site1": torch.full((50,), 4.0)}
            ok = await asyncio.gather(
                *[
                    members[s].allreduce(
                        x[s], round=1, participants=survivors, weights={"site0": 1.0, "site1": 1.0}
                    )
                    for s in survivors
                ]
            )
            # The survivors keep nothing of the failed round (the lost site, which
            # never entered a round, still holds what was sent to it).
            leftovers = {k for s in survivors for k in members[s].inbox.buffers if k[0] == 0}
        finally:
            await _close(members)
        return failed, ok, leftovers

    failed, ok, leftovers = asyncio.run(main())
    assert all(isinstance(r, RoundError) for r in failed)
    assert all(torch.equal(r, torch.full((50,), 3.0)) for r in ok)
    assert not leftovers


@pytest.mark.slow
def test_bench_allreduce_runs_site_processes_over_the_emulator():
    import json
    import subprocess
    import sys

    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "isthmus",
            "bench",
            "allreduce",
            "--sites",
            "3",
            "--size-mib",
            "2",
            "--rtt-ms",
            "10",
            "--bandwidth-mbit",
            "400",
            "--repeats",
            "1",
            "--connections",
            "2",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["connections_per_peer"] == 2  # every chunk dealt over two per peer
    assert report["identical_on_all_sites"]
    assert report["data_plane_over_theoretical"] == pytest.approx(1.0, abs=0.02)
    assert report["max_abs_error"] < 1e-5
    assert report["emulator_wire_bytes"] >= report["data_plane_bytes_per_round"]
    assert 0 < report["efficiency"] <= 1.2


@pytest.mark.slow
def test_a_failed_round_in_a_site_process_is_reported_with_its_error():
    """Every chunk corrupted after its checksum: each site gives a chunk up and its
    round fails; the launcher reports each site's own error, not a traceback."""
    from isthmus.deploy.bench.allreduce import SitesFailed, run_sites
    from isthmus.inter.outbox import MAX_REFUSALS

    flags = ["--size-mib", "0.05", "--chunk-kib", "16", "--repeats", "0"]
    with pytest.raises(SitesFailed) as info:
        run_sites(2, [*flags, "--deadline-s", "10", "--corrupt-payloads", "1.0"], link="{}")
    errors = info.value.errors
    assert sorted(errors) == ["site0", "site1"]
    # A site whose round failed at once may have exited before the other said hello:
    # that one then reports the peer it could not reach.
    assert any(f"refused {MAX_REFUSALS} times" in e for e in errors.values()), errors
    for site, error in errors.items():
        other = "site1" if site == "site0" else "site0"
        assert f"site {other!r}" in error


def _run_ring(n_sites, n, codec="none"):
    async def main():
        names, members = await _group(n_sites, codec)
        w = {s: float(i + 1) for i, s in enumerate(names)}
        inputs = _inputs(names, n, seed=3)
        try:
            outs = await asyncio.gather(
                *[
                    members[s].allreduce(
                        inputs[s], round=0, participants=names, weights=w, algorithm="ring"
                    )
                    for s in names
                ]
            )
        finally:
            await _close(members)
        return names, inputs, w, dict(zip(names, outs, strict=True))

    return asyncio.run(main())


@pytest.mark.parametrize("n_sites", [2, 3, 5])
@pytest.mark.parametrize("n", [0, 1, 7, 10_007])
def test_ring_is_exact_weighted_and_identical_everywhere(n_sites, n):
    names, inputs, weights, outs = _run_ring(n_sites, n)
    for name in names:
        assert torch.equal(outs[name], outs[names[0]]), "sites disagree"
    if n:
        assert torch.allclose(outs[names[0]].double(), _reference(inputs, weights), atol=1e-5)


def test_ring_with_a_lossy_codec_stays_identical_and_within_s_encodes():
    names, inputs, weights, outs = _run_ring(3, 20_000, codec="int8")
    for name in names:
        assert torch.equal(outs[name], outs[names[0]])
    reference = _reference(inputs, weights)
    # Partial sums are re-encoded at every hop: up to S encodes of values no
    # larger than the sum of the weighted inputs.
    c = parse_codec("int8")
    magnitude = sum(inputs[s].abs().double() * weights[s] for s in names) / sum(weights.values())
    bound = 3 * c.max_error(magnitude.float()).max() * 2
    assert float((outs[names[0]].double() - reference).abs().max()) <= float(bound)


@pytest.mark.parametrize(
    ("slow_pair", "n", "expected"),
    [
        (None, 500_000, "direct"),  # 2 MB: two trips of a third each beat one of it all
        (None, 5000, "gather"),  # 20 kB: the latency decides, and gather has one trip
        (("site0", "site2"), 5000, "ring"),
    ],
)
def test_auto_picks_the_algorithm_the_cost_model_predicts(slow_pair, n, expected):
    from isthmus.sim.cost import LinkCost

    def costs(a, b):
        if slow_pair and {a, b} == set(slow_pair):
            return LinkCost.of(bandwidth_mbit=5, rtt_ms=50)
        return LinkCost.of(bandwidth_mbit=1000, rtt_ms=10)

    async def main():
        names, members = await _group(4)
        for member in members.values():
            member.link_costs = costs
        inputs = _inputs(names, n)
        w = {s: 1.0 for s in names}
        try:
            outs = await asyncio.gather(
                *[
                    members[s].allreduce(
                        inputs[s], round=0, participants=names, weights=w, algorithm="auto"
                    )
                    for s in names
                ]
            )
            chosen = {members[s].last_algorithm for s in names}
        finally:
            await _close(members)
        return names, inputs, w, outs, chosen

    _, inputs, w, outs, chosen = asyncio.run(main())
    assert chosen == {expected}
    assert all(torch.equal(o, outs[0]) for o in outs)
    assert torch.allclose(outs[0].double(), _reference(inputs, w), atol=1e-5)


def test_auto_without_link_costs_is_refused():
    async def main():
        names, members = await _group(2)
        try:
            with pytest.raises(ValueError, match="'auto' needs link costs"):
                await members["site0"].allreduce(
                    torch.ones(4),
                    round=0,
                    participants=names,
                    weights={s: 1.0 for s in names},
                    algorithm="auto",
                )
        finally:
            await _close(members)

    asyncio.run(main())


def _repeated_rounds(codec: str, feedback: str | None, rounds: int = 20):
    """The same inputs averaged ``rounds`` times: the mean result's error, and the
    last result's."""

    async def main():
        names, members = await _group(3, codec)
        weights = {s: 1.0 for s in names}
        inputs = _inputs(names, 20_000)
        total = torch.zeros(20_000, dtype=torch.float64)
        try:
            for r in range(rounds):
                outs = await asyncio.gather(
                    *[
                        members[s].allreduce(
                            inputs[s],
                            round=r,
                            participants=names,
                            weights=weights,
                            feedback=feedback,
                        )
                        for s in names
                    ]
                )
                assert all(torch.equal(o, outs[0]) for o in outs), "sites disagree"
                total += outs[0].double()
        finally:
            await _close(members)
        reference = _reference(inputs, weights)
        return (total / rounds - reference).abs().mean().item()

    return asyncio.run(main())


def test_error_feedback_carries_what_the_codec_lost_into_the_next_round():
    # Without feedback every round loses the same thing; with it, each site's
    # loss is sent again next round, so the rounds' mean approaches the exact
    # average (the owner's encode of the average is the part left).
    without = _repeated_rounds("int4", None)
    with_feedback = _repeated_rounds("int4", "model")
    assert with_feedback < 0.5 * without, (with_feedback, without)
    assert _repeated_rounds("none", "model") < 1e-6  # exact codecs lose nothing


def test_chunks_no_round_can_use_are_refused_not_held():
    """A peer's chunks wait for their round to open, but only so far ahead; and a
    shard's chunks must agree on how many there are."""
    from isthmus.inter.allreduce import MAX_ROUNDS_AHEAD
    from isthmus.inter.chunks import ChunkError, ReceivedChunk, checksum, verify

    codec = parse_codec("none")

    def received(round, index=0, count=2):
        (chunk,) = encode_chunks(codec, torch.ones(4), round=round, shard=0, max_chunk_bytes=4096)
        chunk.index, chunk.count = index, count
        chunk.checksum = checksum(chunk, chunk.payload)
        return ReceivedChunk.from_wire(chunk, chunk.payload, verify(chunk, chunk.payload), "b", 0)

    async def main():
        engine = CrossSiteAllReduce(Identity(job=JOB, site="a", rank=0), {"b": "127.0.0.1:1"})
        try:
            engine.receive(received(MAX_ROUNDS_AHEAD))  # held until its round opens
            with pytest.raises(ChunkError, match="rounds ahead"):
                engine.receive(received(MAX_ROUNDS_AHEAD + 1))
            with pytest.raises(ChunkError, match="earlier chunks said 2"):
                engine.receive(received(MAX_ROUNDS_AHEAD, index=1, count=3))
            # A round that is over here: a straggler or a replay, dropped and counted.
            engine.skip_to(4)
            held = set(engine.inbox.buffers)
            assert engine.receive(received(3)) is False
            assert engine.receive(received(4)) is True
            assert engine.inbox.stale == 1 and (3, 0, "b") not in engine.inbox.buffers
            assert set(engine.inbox.buffers) == held | {(4, 0, "b")}
        finally:
            await engine.close()

    asyncio.run(main())


def test_a_replayed_chunk_of_a_round_that_is_over_is_counted_and_never_applied(caplog):
    """Through the peer service: a chunk of a round this rank has left is acknowledged
    (nothing for the sender to send again), counted as STALE_ROUND, logged, and never
    reaches a buffer."""
    from isthmus.inter.peer import PeerServer
    from isthmus.inter.peer_client import PeerClient

    codec = parse_codec("none")
    chunks = list(encode_chunks(codec, torch.ones(8), round=2, shard=0, max_chunk_bytes=4096))

    async def main():
        engine = CrossSiteAllReduce(Identity(job=JOB, site="a", rank=0), {"b": "127.0.0.1:1"})
        server = PeerServer(Identity(job=JOB, site="a", rank=0), ["a", "b"], engine.receive)
        port = await server.start("127.0.0.1", 0)
        client = PeerClient(Identity(job=JOB, site="b", rank=0), f"127.0.0.1:{port}")
        try:
            engine.skip_to(3)  # round 2 is over here
            first = await client.exchange(chunks)
            again = await client.exchange(chunks)  # the replay
            return first + again, server.servicer.refusals, dict(engine.inbox.buffers)
        finally:
            await client.close()
            await server.stop()
            await engine.close()

    with caplog.at_level("INFO", logger="isthmus.inter.peer"):
        acks, refusals, buffers = asyncio.run(main())
    assert all(a.ok for a in acks) and len(acks) == 2 * len(chunks)
    assert refusals["STALE_ROUND"] == 2 * len(chunks)
    assert buffers == {}
    assert "of round 2, which is over here: dropped" in caplog.text


def test_a_round_ends_when_its_result_is_in_and_its_last_sends_finish_after():
    """Over a 1 s RTT link a site holds the average once the peer's result arrives,
    half a round trip before the peer's acknowledgement of this site's own result
    can: the round returns without waiting for it, and the send completes after."""
    from isthmus.job.link import LinkParams
    from isthmus.sim.emulator import BackgroundEmulator
    from isthmus.sim.topology import EmulatedSite, Topology

    async def main():
        names = ["a", "b"]
        members, ports = {}, {}
        for name in names:
            identity = Identity(job=JOB, site=name, rank=0, layout_fingerprint="L")
            members[name] = CrossSiteAllReduce(identity, {}, deadline_s=30.0)
            ports[name] = await members[name].start("127.0.0.1", 0)
        topology = Topology.full_mesh(
            [EmulatedSite(name=n, listen=(("127.0.0.1", ports[n]),)) for n in names],
            default=LinkParams.symmetric(rtt_ms=1000),
        )
        inputs = _inputs(names, 10_007)
        weights = {s: 1.0 for s in names}
        with BackgroundEmulator(topology) as wan:
            for name, member in members.items():
                (other,) = [n for n in names if n != name]
                member.peers = {other: "{}:{}".format(*wan.dial_address(name, other))}
                member.server.servicer.sites = set(names)
            try:
                await asyncio.gather(*(m.connect() for m in members.values()))
                outs = await asyncio.gather(
                    *(
                        members[s].allreduce(
                            inputs[s], round=0, participants=names, weights=weights
                        )
                        for s in names
                    )
                )
                pending = {s: len(members[s].outgoing.deliveries) for s in names}
                for member in members.values():
                    await member.flush(10.0)
                after = {s: len(members[s].outgoing.deliveries) for s in names}
                failed = {s: members[s].failed_deliveries for s in names}
                phases = {s: members[s].last.phases for s in names}
            finally:
                await _close(members)
        return outs, pending, after, failed, phases, inputs, weights

    outs, pending, after, failed, phases, inputs, weights = asyncio.run(main())
    expected = _reference(inputs, weights).float()
    assert all(torch.equal(out, outs[0]) for out in outs)
    assert torch.allclose(outs[0], expected, atol=1e-6)
    # Each site's result is on its way to the other (its acknowledgement half a round
    # trip off); the contribution's acknowledgement may be too, racing the result.
    assert all(1 <= count <= 2 for count in pending.values()), pending
    assert after == {"a": 0, "b": 0} and failed == {"a": 0, "b": 0}
    for milestones in phases.values():
        assert list(milestones) == ["contributions", "results"]
        assert 0 < milestones["contributions"] <= milestones["results"]


def test_a_send_that_fails_after_its_round_is_logged_and_one_that_hangs_is_given_up(caplog):
    """What a round leaves running is never lost silently: a failure is counted and
    logged, and close() waits only so long for the rest, naming what it gave up."""

    async def main():
        engine = CrossSiteAllReduce(Identity(job=JOB, site="a", rank=0), {"b": "127.0.0.1:1"})

        async def fails():
            await asyncio.sleep(0.01)
            raise RoundError("b", "round 3: sending to site 'b' failed: peer is unreachable")

        hangs = asyncio.ensure_future(asyncio.sleep(3600))
        failing = asyncio.ensure_future(fails())
        engine.outgoing.outlive(3, [("b", failing), ("c", hangs)])
        # On the failure itself, not after a sleep: on a loaded machine both timers can
        # fire in one loop turn, before the failure's callbacks have run.
        await asyncio.wait({failing})
        await asyncio.sleep(0)  # the callbacks that count it
        failed = engine.failed_deliveries
        await engine.flush(0.05)
        left = len(engine.outgoing.deliveries)
        await engine.close()
        return failed, left, hangs.cancelled()

    with caplog.at_level("WARNING", logger="isthmus.inter.allreduce"):
        failed, left, cancelled = asyncio.run(main())
    assert failed == 1
    assert "round 3, over here, could not deliver" in caplog.text
    assert "peer is unreachable" in caplog.text
    assert left == 0 and cancelled
    assert "given up: round 3 to site 'c'" in caplog.text


def test_topk_ends_identical_carries_the_union_and_sends_a_fraction_of_the_bytes():
    """The sparse codec through the direct algorithm: each owner encodes the average of
    the sites' sparse contributions at the density of their union, so every site
    ends with the same values, non-zero at no more positions than the sites sent."""
    spec, n_sites, n = "topk:chunk=256,density=0.05", 3, 30_000
    names, _, _, outs, stats = _run(n_sites, n, codec=spec)
    for name in names:
        assert torch.equal(outs[name], outs[names[0]]), "sites disagree"
    codec = parse_codec(spec)
    nonzero = int((outs[names[0]] != 0).sum())
    assert (
        codec.sparse.per_chunk * n / 256
        < nonzero
        <= n_sites * codec.sparse.per_chunk * (n / 256 + 2 * n_sites)
    )
    # Up: (S-1)/S of the values at the codec's density; down: the same share at the
    # union's (S times as dense). Far below float32's 2 (S-1)/S * 4 bytes a value.
    share = (n_sites - 1) / n_sites * n
    union = codec.for_sum_of(n_sites)
    expected = share * (codec.bytes_per_value() + union.bytes_per_value())
    for name in names:
        assert stats[name].bytes_sent == pytest.approx(expected, rel=0.05)
        assert stats[name].bytes_sent < 0.08 * 2 * share * 4


def test_topk_with_error_feedback_sends_the_rest_in_later_rounds():
    # 20 rounds of the same inputs: without feedback 95% of each contribution is
    # never sent; with it, the rounds' mean approaches the exact average.
    spec = "topk:chunk=256,density=0.05"
    without = _repeated_rounds(spec, None)
    with_feedback = _repeated_rounds(spec, "model")
    assert with_feedback < 0.5 * without, (with_feedback, without)


def test_topk_refuses_the_ring_and_takes_direct_for_auto_without_link_costs():
    async def main():
        names, members = await _group(2, "topk")
        try:
            with pytest.raises(ValueError, match="the topk codec needs the direct or gather"):
                await members["site0"].allreduce(
                    torch.ones(10),
                    round=0,
                    participants=names,
                    weights={s: 1.0 for s in names},
                    algorithm="ring",
                )
            assert members["site0"]._pick_algorithm("auto", torch.ones(10), names) == "direct"
        finally:
            await _close(members)

    asyncio.run(main())


@pytest.mark.parametrize("codec", ["int2", "topk"])
def test_an_exact_round_crosses_as_float32_whatever_the_codec(codec):
    """A round's seal carries counts and flags that must come through unchanged: with
    ``exact`` the round ignores the engine's codec (int2 would round small digits to
    zero, topk's never-zero levels would turn zero flags into refusals)."""

    async def main():
        names, members = await _group(3, codec)
        votes = {s: torch.zeros(18) for s in names}
        for i, s in enumerate(names):
            votes[s][6 * i : 6 * i + 4] = torch.tensor([2048.0, 2.0, 1.0, 0.0])
        try:
            outs = await asyncio.gather(
                *[
                    members[s].allreduce(
                        votes[s],
                        round=0,
                        participants=names,
                        weights={n: 1.0 for n in names},
                        exact=True,
                    )
                    for s in names
                ]
            )
        finally:
            await _close(members)
        return outs

    outs = asyncio.run(main())
    expected = torch.tensor([2048.0, 2.0, 1.0, 0.0, 0.0, 0.0] * 3) / 3
    for out in outs:
        assert torch.equal((out * 3).round(), (expected * 3).round())
        assert torch.allclose(out, expected, rtol=0, atol=1e-6)


def _averaged_over(connections: int, n_sites: int, n: int, monkeypatch) -> tuple[list, Counter]:
    """Every site's result of one round with ``connections`` to each peer, and how
    many chunks each connection (by index) carried."""
    carried: Counter[int] = Counter()
    exchange = PeerClient.exchange

    async def counting(self, chunks, *, connection=0, **kwargs):
        async def counted():
            async for chunk in chunks:
                carried[connection] += 1
                yield chunk

        return await exchange(self, counted(), connection=connection, **kwargs)

    settings = TransportSettings(max_chunk_bytes=4096, connections_per_peer=connections)

    async def main():
        names, members = await _group(n_sites, settings=settings)
        inputs = _inputs(names, n)
        weights = {s: 1.0 for s in names}
        try:
            return await asyncio.gather(
                *[
                    members[s].allreduce(inputs[s], round=0, participants=names, weights=weights)
                    for s in names
                ]
            )
        finally:
            await _close(members)

    with monkeypatch.context() as patched:
        patched.setattr(PeerClient, "exchange", counting)
        return asyncio.run(main()), carried


@pytest.mark.parametrize("n_sites, connections", [(2, 3), (3, 2)])
def test_a_peer_s_chunks_are_dealt_over_every_connection_and_the_result_is_the_same(
    monkeypatch, n_sites, connections
):
    """A long fat link needs several TCP connections (one carries at most its window
    per round trip): every call's chunks are dealt over all of them, each arrives
    once, and every site ends with what one connection gives, bit for bit."""
    n = 60_000  # about 60 chunks of 4 KiB a link and direction: all connections get some
    one, carried_by_one = _averaged_over(1, n_sites, n, monkeypatch)
    several, carried = _averaged_over(connections, n_sites, n, monkeypatch)
    assert set(carried_by_one) == {0}
    assert set(carried) == set(range(connections)), carried
    assert sum(carried.values()) == sum(carried_by_one.values())  # nothing sent twice
    for out in several:
        assert torch.equal(out, one[0])


def test_connections_for_a_link_fill_its_bandwidth_delay_product():
    window = 16 * 2**20
    # 1 Gbit/s at 300 ms holds 37.5 MB: one 16 MiB window fills 45% of it.
    assert connections_for(1e9 / 8, 0.3, window) == 3
    assert connections_for(200e6 / 8, 0.06, window) == 1
    assert connections_for(None, 0.3, window) == 1  # uncapped: the window is not the limit
    assert connections_for(100e9 / 8, 0.3, window) == 16  # at most MAX_CONNECTIONS_PER_PEER
    with pytest.raises(ValueError, match="connections_per_peer"):
        TransportSettings(connections_per_peer=0)


@pytest.mark.parametrize(
    ("algorithm", "codec"),
    [("direct", "int2+zstd"), ("gather", "int8"), ("ring", "int4+zstd"), ("direct", "topk")],
)
def test_each_site_receives_the_bytes_its_peers_sent_it(algorithm, codec):
    """Bytes received count what crossed the WAN (the encoded payload), not the decoded
    float32 volume: each site's figure is the sum of what its peers sent it, and the
    sites' received bytes add up to their sent bytes."""

    async def main():
        names, members = await _group(3, codec)
        w = {s: 1.0 for s in names}
        inputs = _inputs(names, 50_000, seed=5)
        try:
            await asyncio.gather(
                *[
                    members[s].allreduce(
                        inputs[s], round=0, participants=names, weights=w, algorithm=algorithm
                    )
                    for s in names
                ]
            )
            stats = {s: members[s].last for s in names}
            sent_to = {s: dict(members[s].bytes_sent_to) for s in names}
        finally:
            await _close(members)
        return names, stats, sent_to

    names, stats, sent_to = asyncio.run(main())
    for site in names:
        from_peers = sum(sent_to[peer].get(site, 0) for peer in names if peer != site)
        assert stats[site].bytes_received == from_peers > 0, (site, stats[site])
        # Far below the decoded volume: each peer's share of 50,000 float32 values.
        assert stats[site].bytes_received < 2 * 50_000 * 4
    assert sum(s.bytes_received for s in stats.values()) == sum(
        s.bytes_sent for s in stats.values()
    )
