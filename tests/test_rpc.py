"""The gRPC floor: a started server's health and port, a checked bind, and what its stop closes."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos import cache_pb2, cache_pb2_grpc
from protos.rpc import CHANNEL_OPTIONS, SERVER_OPTIONS, start_server, wait_serving

SERVICE = cache_pb2.DESCRIPTOR.services_by_name["Cache"].full_name


async def start(port: int = 0, on_stop=()):
    return await start_server(
        cache_pb2_grpc.CacheServicer(),
        cache_pb2_grpc.add_CacheServicer_to_server,
        (SERVICE,),
        "127.0.0.1",
        port,
        on_stop=on_stop,
    )


async def test_a_started_server_says_serving_on_its_port_and_closes_on_stop():
    closed = []

    async def close() -> None:
        closed.append(True)

    started = await start(on_stop=[close])
    try:
        assert started.port > 0
        async with grpc.aio.insecure_channel(f"127.0.0.1:{started.port}", options=CHANNEL_OPTIONS) as channel:
            await wait_serving(channel, 5, service=SERVICE)
            await started.set_serving(False)
            reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
            assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING
    finally:
        await started.stop(None)
    assert closed == [True]


async def test_a_second_server_on_a_busy_port_fails_naming_the_port():
    first = await start()
    closed = []

    async def close() -> None:
        closed.append(True)

    try:
        with pytest.raises(OSError, match=f"port {first.port} is taken"):
            await start(first.port, on_stop=[close])
        assert closed == [True]  # what the caller opened for the server that did not start is closed
    finally:
        await first.stop(None)


def test_one_message_limit_everywhere_and_no_port_reuse():
    limits = {value for name, value in CHANNEL_OPTIONS if name.startswith("grpc.max_")}
    assert len(limits) == 1
    assert ("grpc.so_reuseport", 0) in SERVER_OPTIONS
