"""A real gRPC call (the standard health service) through an emulated link."""

from __future__ import annotations

import time
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from isthmus.job.link import LinkParams

pytestmark = pytest.mark.serial  # a round trip through the proxy is timed: alone on the machine


def test_health_check_crosses_the_link_with_its_latency(two_sites):
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    servicer.set("isthmus", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with two_sites(("127.0.0.1", port), LinkParams.symmetric(rtt_ms=40)) as wan:
            host, proxied = wan.dial_address("a", "b")
            with grpc.insecure_channel(f"{host}:{proxied}") as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                request = health_pb2.HealthCheckRequest(service="isthmus")
                assert (
                    stub.Check(request, timeout=10).status == health_pb2.HealthCheckResponse.SERVING
                )
                start = time.monotonic()
                reply = stub.Check(request, timeout=10)
                elapsed_ms = (time.monotonic() - start) * 1e3
            stats = wan.stats()["links"][0]
    finally:
        server.stop(grace=None)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    assert 39 <= elapsed_ms < 200
    assert stats["a->b"]["bytes"] > 0 and stats["b->a"]["bytes"] > 0
