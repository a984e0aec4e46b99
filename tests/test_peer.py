"""The peer service over real gRPC on loopback: sessions, chunks, integrity, health, deadlines."""

from __future__ import annotations

import asyncio
import socket

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from isthmus.inter.chunks import ReceivedChunk, encode_chunks
from isthmus.inter.codecs import parse_codec
from isthmus.inter.peer import PROTOCOL_VERSION, AuthInterceptor, Identity, PeerError, PeerServer
from isthmus.inter.peer_client import PeerClient
from isthmus.proto import wire_pb2

SITES = ("us-east", "eu-west", "ap-south")
EAST = Identity(job="demo", site="us-east", rank=0, layout_fingerprint="abc")
WEST = Identity(job="demo", site="eu-west", rank=0, layout_fingerprint="abc")


def run(coro):
    return asyncio.run(coro)


async def _serve(received: list[ReceivedChunk], **kwargs) -> tuple[PeerServer, str]:
    server = PeerServer(EAST, SITES, received.append, **kwargs)
    port = await server.start("127.0.0.1", 0)
    return server, f"127.0.0.1:{port}"


def test_a_session_is_accepted_between_sites_of_one_job():
    async def main():
        server, address = await _serve([])
        client = PeerClient(WEST, address, deadline_s=10)
        try:
            reply = await client.hello()
        finally:
            await client.close()
            await server.stop()
        return reply

    reply = run(main())
    assert reply.accepted and (reply.site, reply.rank) == ("us-east", 0)
    assert reply.protocol_version == PROTOCOL_VERSION


@pytest.mark.parametrize(
    ("identity", "version", "message"),
    [
        (
            Identity(job="other", site="eu-west", rank=0, layout_fingerprint="abc"),
            None,
            "peer belongs to job 'other', this is job 'demo'",
        ),
        (
            Identity(job="demo", site="mars", rank=0, layout_fingerprint="abc"),
            None,
            "site 'mars' is not another site of job 'demo'",
        ),
        (
            Identity(job="demo", site="eu-west", rank=0, layout_fingerprint="xyz"),
            None,
            "tensor/pipeline degrees or parameter shapes differ",
        ),
        (
            Identity(
                job="demo", site="eu-west", rank=0, layout_fingerprint="xyz", layout="tp=2 pp=1"
            ),
            None,
            "site 'eu-west' has layout 'tp=2 pp=1', this site 'abc'",
        ),
        (WEST, PROTOCOL_VERSION + 1, f"peer speaks protocol {PROTOCOL_VERSION + 1}"),
    ],
)
def test_a_stranger_is_refused_with_the_reason(identity, version, message):
    async def main():
        server, address = await _serve([])
        try:
            if version is None:
                client = PeerClient(identity, address, deadline_s=10)
                with pytest.raises(PeerError, match="refused the session") as info:
                    await client.hello()
                await client.close()
                return str(info.value), server.servicer.refused
            request = wire_pb2.Handshake(
                job="demo",
                site="eu-west",
                rank=0,
                protocol_version=version,
                layout_fingerprint="abc",
            )
            async with grpc.aio.insecure_channel(address) as channel:
                from isthmus.proto import wire_pb2_grpc

                reply = await wire_pb2_grpc.PeerServiceStub(channel).Hello(request, timeout=10)
            assert not reply.accepted and reply.error.code == wire_pb2.PROTOCOL_MISMATCH
            return reply.error.message, server.servicer.refused
        finally:
            await server.stop()

    text, refused = run(main())
    assert message in text
    assert refused and message in refused[-1] and "127.0.0.1" in refused[-1]


def test_chunks_arrive_verified_and_whole():
    values = torch.randn(100_003, generator=torch.Generator().manual_seed(1))
    codec = parse_codec("int8")
    chunks = list(
        encode_chunks(codec, values, round=3, shard=1, max_chunk_bytes=16 * 1024, weight=7.0)
    )
    assert len(chunks) > 1

    async def main():
        received: list[ReceivedChunk] = []
        server, address = await _serve(received)
        client = PeerClient(WEST, address, deadline_s=20)
        try:
            await client.hello()
            acks = await client.exchange(chunks)
        finally:
            await client.close()
            await server.stop()
        return acks, received

    acks, received = run(main())
    assert [a.index for a in acks] == list(range(len(chunks))) and all(a.ok for a in acks)
    assert len(received) == len(chunks)
    assert {(c.site, c.round, c.shard, c.weight) for c in received} == {("eu-west", 3, 1, 7.0)}
    whole = torch.empty_like(values)
    for chunk in received:
        chunk.decode_into(whole)
    # Each chunk is encoded on its own: compare with the same chunking, decoded locally.
    expected = torch.cat(
        [
            codec.decode(codec.encode(values[a : a + 2048 * 8]))
            for a in range(0, values.numel(), 2048 * 8)
        ]
    )
    assert torch.allclose(whole, values, atol=float(codec.max_error(values).max()) * 1.01)
    assert whole.shape == expected.shape


def test_a_corrupted_chunk_is_refused_and_never_applied():
    values = torch.randn(10_000)
    codec = parse_codec("bf16")
    chunks = list(encode_chunks(codec, values, round=1, shard=0, max_chunk_bytes=4096))
    bad = wire_pb2.Chunk()
    bad.CopyFrom(chunks[2])
    payload = bytearray(bad.payload)
    payload[10] ^= 0x40  # corrupted after its checksum was computed
    bad.payload = bytes(payload)

    async def main():
        received: list[ReceivedChunk] = []
        server, address = await _serve(received)
        client = PeerClient(WEST, address, deadline_s=20)
        try:
            first = await client.exchange([*chunks[:2], bad, *chunks[3:]])
            held = list(received)
            resend = await client.exchange(chunks)
        finally:
            await client.close()
            await server.stop()
        return first, held, resend, received

    first, held, resend, received = run(main())
    refused = [a for a in first if not a.ok]
    assert len(refused) == 1 and refused[0].index == 2
    assert refused[0].error.code == wire_pb2.CHECKSUM_MISMATCH
    assert 2 not in {c.index for c in held}  # the bad chunk was never handed on
    assert all(a.ok for a in resend)
    whole = torch.empty_like(values)
    for chunk in received:
        chunk.decode_into(whole)
    assert torch.equal(whole, codec.decode(codec.encode(values)))


def test_exchange_from_another_job_is_denied():
    async def main():
        server, address = await _serve([])
        stranger = PeerClient(Identity(job="other", site="eu-west", rank=0), address, deadline_s=10)
        try:
            with pytest.raises(PeerError, match="PERMISSION_DENIED"):
                await stranger.exchange(
                    encode_chunks(
                        parse_codec("none"), torch.ones(4), round=0, shard=0, max_chunk_bytes=1024
                    )
                )
        finally:
            await stranger.close()
            await server.stop()

    run(main())


def test_health_service_answers_serving():
    async def main():
        server, address = await _serve([])
        try:
            async with grpc.aio.insecure_channel(address) as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                request = health_pb2.HealthCheckRequest(service="isthmus.wire.PeerService")
                return (await stub.Check(request, timeout=10)).status
        finally:
            await server.stop()

    assert run(main()) == health_pb2.HealthCheckResponse.SERVING


def test_the_auth_hook_can_refuse_a_call():
    def check(metadata: dict[str, str]) -> str | None:
        return None if metadata.get("isthmus-site") else "no credentials"

    async def main():
        server, address = await _serve([], interceptors=[AuthInterceptor(check)])
        client = PeerClient(WEST, address, deadline_s=10)
        try:
            with pytest.raises(PeerError, match="UNAUTHENTICATED: no credentials"):
                await client.hello()  # Hello carries no metadata: refused by the hook
            acks = await client.exchange(
                encode_chunks(
                    parse_codec("none"), torch.ones(4), round=0, shard=0, max_chunk_bytes=1024
                )
            )
        finally:
            await client.close()
            await server.stop()
        return acks, server.metrics.calls

    acks, calls = run(main())
    assert all(a.ok for a in acks)
    assert calls["/isthmus.wire.PeerService/Exchange"] == 1


def test_a_peer_that_never_answers_fails_by_the_deadline_naming_it():
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(1)  # accepts TCP, never speaks HTTP/2
    address = f"127.0.0.1:{silent.getsockname()[1]}"

    async def main():
        client = PeerClient(WEST, address, deadline_s=1.5)
        loop = asyncio.get_running_loop()
        start = loop.time()
        try:
            with pytest.raises(PeerError, match=f"peer {address} did not answer within 1.5 s"):
                await client.hello()
        finally:
            await client.close()
        return loop.time() - start

    try:
        assert run(main()) < 5
    finally:
        silent.close()


def test_a_port_in_use_is_named():
    async def main():
        server, address = await _serve([])
        port = int(address.rsplit(":", 1)[1])
        other = PeerServer(EAST, SITES, lambda t: None)
        try:
            with pytest.raises(PeerError, match=f"cannot listen on 127.0.0.1:{port}"):
                await other.start("127.0.0.1", port)
        finally:
            await server.stop()

    run(main())
