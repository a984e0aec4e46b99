"""What a peer may hold at a rank: streams per site, message size, early bytes (issue 38).

Real gRPC throughout: an attacker's channel is a plain grpc channel that ignores
Isthmus's own limits on what it sends, as an attacker's program would."""

from __future__ import annotations

import asyncio
import dataclasses
import logging

import grpc
import pytest
import torch

from isthmus.inter.allreduce import CrossSiteAllReduce
from isthmus.inter.allreduce.incoming import Inbox
from isthmus.inter.chunks import ChunkError, ReceivedChunk, encode_chunks
from isthmus.inter.codecs import parse_codec
from isthmus.inter.peer import META_JOB, META_RANK, META_SITE, Identity, PeerServer
from isthmus.inter.transport import TransportSettings
from isthmus.proto import wire_pb2, wire_pb2_grpc

A = Identity(job="j", site="a", rank=0, layout_fingerprint="L")
AS_B = ((META_JOB, "j"), (META_SITE, "b"), (META_RANK, "0"))


async def _server(
    settings: TransportSettings,
) -> tuple[PeerServer, wire_pb2_grpc.PeerServiceStub, grpc.aio.Channel]:
    server = PeerServer(A, ["a", "b"], lambda chunk: None, settings=settings)
    port = await server.start("127.0.0.1", 0)
    channel = grpc.aio.insecure_channel(
        f"127.0.0.1:{port}", options=[("grpc.max_send_message_length", 1 << 30)]
    )
    return server, wire_pb2_grpc.PeerServiceStub(channel), channel


async def _hold_open(stub: wire_pb2_grpc.PeerServiceStub, release: asyncio.Event) -> str:
    """One Exchange stream that sends nothing until ``release``; how it ended."""

    async def nothing():
        await release.wait()
        return
        yield  # an async generator that yields nothing

    try:
        async for _ in stub.Exchange(nothing(), metadata=AS_B, timeout=20):
            pass
        return "OK"
    except grpc.aio.AioRpcError as exc:
        return exc.code().name


def test_streams_beyond_the_sites_limit_are_cut_off_counted_and_named(caplog):
    caplog.set_level(logging.WARNING, logger="isthmus.inter.peer")

    async def main():
        server, stub, channel = await _server(TransportSettings(max_streams_per_site=3))
        release = asyncio.Event()
        try:
            holders = [asyncio.create_task(_hold_open(stub, release)) for _ in range(3)]
            while server.servicer.streams["b"] < 3:
                await asyncio.sleep(0.01)
            flood = await asyncio.gather(*[_hold_open(stub, release) for _ in range(20)])
            release.set()
            held = await asyncio.gather(*holders)
            return flood, held, dict(server.servicer.refusals), server.servicer.streams["b"]
        finally:
            await channel.close()
            await server.stop()

    flood, held, refusals, still_open = asyncio.run(main())
    assert flood == ["RESOURCE_EXHAUSTED"] * 20
    assert held == ["OK"] * 3  # the streams within the limit were never touched
    assert refusals == {"TOO_MANY_STREAMS": 20}
    assert still_open == 0  # every stream that ended gave its place back
    assert "site 'b'" in caplog.text and "max_streams_per_site" in caplog.text


def test_a_message_over_the_size_limit_is_cut_off_and_named(caplog):
    caplog.set_level(logging.WARNING, logger="isthmus.inter.peer")
    settings = TransportSettings(max_chunk_bytes=64 * 1024)

    async def main():
        server, stub, channel = await _server(settings)
        big = wire_pb2.Chunk(round=0, payload=b"x" * (settings.max_message_bytes + 1024))
        try:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                async for _ in stub.Exchange(iter([big]), metadata=AS_B, timeout=10):
                    pass
            return caught.value, dict(server.servicer.refusals)
        finally:
            await channel.close()
            await server.stop()

    error, refusals = asyncio.run(main())
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "larger than" in error.details()
    assert refusals == {"TOO_LARGE": 1}
    assert "message of" in caplog.text and "site 'b'" in caplog.text


def _early_chunk(round: int, index: int, size: int) -> ReceivedChunk:
    [chunk] = encode_chunks(
        parse_codec("none"), torch.zeros(size // 4), round=round, shard=0, max_chunk_bytes=1 << 20
    )
    received = ReceivedChunk.from_wire(chunk, chunk.payload, parse_codec("none"), "b", 0)
    return dataclasses.replace(received, index=index, count=1000)


def test_a_site_may_hold_only_so_many_bytes_before_their_round_opens():
    inbox = Inbox(max_early_bytes_per_site=10_000)
    inbox.enter(0)
    for index in range(2):  # 8,000 bytes for round 1, not yet open: held
        assert inbox.receive(_early_chunk(1, index, 4000))
    assert inbox.early_bytes("b") == 8000
    with pytest.raises(ChunkError) as refused:  # 12,000 > 10,000: not taken
        inbox.receive(_early_chunk(1, 2, 4000))
    assert refused.value.code == wire_pb2.ROUND_AHEAD  # the sender sends it again later
    assert "10,000" in str(refused.value)
    # Once the round opens its chunks are placed, no longer held early.
    inbox.leave(0)
    inbox.enter(1)
    inbox.expect(round=1, shard=0, site="b", size=1000 * 1000)
    assert inbox.early_bytes("b") == 0
    assert inbox.receive(_early_chunk(1, 2, 4000))


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_streams_per_site", 0),
        ("max_streams_per_connection", 0),
        ("max_calls", 0),
        ("max_early_bytes_per_site", 1024),
    ],
)
def test_limits_out_of_range_are_refused_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        TransportSettings(**{field: value})


def test_real_sites_go_on_through_a_limit_far_below_what_they_open():
    """Sites whose streams are refused for the limit send them again: with one stream
    per site allowed, a three-site all-reduce still ends exact and identical."""
    settings = TransportSettings(max_streams_per_site=1)

    async def main():
        names = ["s0", "s1", "s2"]
        members, ports = {}, {}
        for name in names:
            identity = Identity(job="j", site=name, rank=0, layout_fingerprint="L")
            members[name] = CrossSiteAllReduce(identity, {}, settings=settings, deadline_s=60)
            ports[name] = await members[name].start("127.0.0.1", 0)
        for name, member in members.items():
            member.peers = {o: f"127.0.0.1:{ports[o]}" for o in names if o != name}
            member.server.servicer.sites = set(names)
        inputs = {n: torch.full((2_000_000,), float(i)) for i, n in enumerate(names)}
        ones = dict.fromkeys(names, 1.0)
        rounds, refused = [], 0
        try:
            for member in members.values():
                await member.connect()
            # A round's result stream to a peer opens beside its contribution stream
            # only if the timing lets it: up to three rounds, until the limit is hit.
            for round in range(3):
                rounds.append(
                    await asyncio.gather(
                        *[
                            members[n].allreduce(
                                inputs[n], round=round, participants=names, weights=ones
                            )
                            for n in names
                        ]
                    )
                )
                refused = sum(
                    m.server.servicer.refusals["TOO_MANY_STREAMS"] for m in members.values()
                )
                if refused:
                    break
            return [out for outs in rounds for out in outs], refused
        finally:
            for member in members.values():
                await member.close()

    outs, refused = asyncio.run(main())
    for out in outs:
        assert torch.equal(out, torch.full((2_000_000,), 1.0))
    assert refused > 0  # the limit was hit, and the refused streams sent again
