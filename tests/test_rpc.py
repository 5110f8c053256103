"""The gRPC floor: a started server's health and port, a checked bind, and what its stop closes."""

from __future__ import annotations

import asyncio
import socket
import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

import protos.rpc
from planner_svc.client import PlannerClient
from protos import cache_pb2, cache_pb2_grpc
from protos.rpc import (
    CHANNEL_OPTIONS,
    INTERNAL_CHANNEL_OPTIONS,
    INTERNAL_KEEPALIVE_MS,
    SERVER_OPTIONS,
    start_server,
    wait_serving,
)

SERVICE = cache_pb2.DESCRIPTOR.services_by_name["Cache"].full_name
PING_MS = 1000  # the internal links' options pinging faster than they do, to keep the test short
IDLE_S = 7 * PING_MS / 1000  # sends nothing for 7 keepalive periods (a default server refused it at 5 s)


class SlowCache(cache_pb2_grpc.CacheServicer):
    """Answers Stat after IDLE_S, sending nothing before."""

    async def Stat(self, request, context):
        await asyncio.sleep(IDLE_S)
        return cache_pb2.StatReply()


def pinging_every(ms: int) -> list[tuple[str, int]]:
    return [
        (name, ms if name == "grpc.keepalive_time_ms" else value) for name, value in INTERNAL_CHANNEL_OPTIONS
    ]


async def start(port: int = 0, on_stop=(), servicer=None):
    return await start_server(
        servicer or cache_pb2_grpc.CacheServicer(),
        cache_pb2_grpc.add_CacheServicer_to_server,
        (SERVICE,),
        "127.0.0.1",
        port,
        on_stop=on_stop,
    )


async def test_a_channel_retries_at_most_a_second_apart_and_finds_a_server_that_came_up_late():
    """While its server is down the channel tries again at most RECONNECT_MAX_MS apart (jittered by up to 20%):
    in 8 s, seven tries or more (ten here), where gRPC's default backoff (1 s growing by 1.6x) makes at most five, and
    minutes apart after a long outage. A server up at last is found within about that."""
    listener = socket.create_server(("127.0.0.1", 0))
    port, tries = listener.getsockname()[1], []

    def refuse() -> None:  # each try: accepted, then closed before any HTTP/2
        while True:
            try:
                connection, _ = listener.accept()
            except OSError:  # closed: the outage is over
                return
            tries.append(connection)
            connection.close()

    refusing = threading.Thread(target=refuse, daemon=True)
    refusing.start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=CHANNEL_OPTIONS) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        loop = asyncio.get_running_loop()
        down_until = loop.time() + 8.0
        while loop.time() < down_until:  # calls fail fast while the channel backs off
            with pytest.raises(grpc.aio.AioRpcError):
                await health.Check(health_pb2.HealthCheckRequest(), timeout=0.5)
            await asyncio.sleep(0.1)
        listener.close()
        refusing.join(5)
        assert len(tries) >= 7, len(tries)
        started = await start(port)
        try:
            up = loop.time()
            while True:
                try:
                    await health.Check(health_pb2.HealthCheckRequest(), timeout=0.5)
                    break
                except grpc.aio.AioRpcError:
                    await asyncio.sleep(0.05)
            assert loop.time() - up < protos.rpc.RECONNECT_MAX_MS * 1.2 / 1000 + 0.6
        finally:
            await started.stop(None)


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
    limits = {value for name, value in CHANNEL_OPTIONS if name.endswith("_message_length")}
    assert len(limits) == 1
    assert ("grpc.so_reuseport", 0) in SERVER_OPTIONS


async def test_an_internal_link_keeps_a_call_that_sends_nothing_open_past_three_keepalive_periods():
    assert INTERNAL_KEEPALIVE_MS >= 10_000  # gRFC A8: no client pings more often than every 10 s
    started = await start(servicer=SlowCache())
    default_server = grpc.aio.server()  # gRPC's own ping policy: 2 pings without data, then GOAWAY
    cache_pb2_grpc.add_CacheServicer_to_server(SlowCache(), default_server)
    default_port = default_server.add_insecure_port("127.0.0.1:0")
    await default_server.start()
    try:
        async with grpc.aio.insecure_channel(
            f"127.0.0.1:{started.port}", options=pinging_every(PING_MS)
        ) as channel:
            await cache_pb2_grpc.CacheStub(channel).Stat(cache_pb2.StatRequest(), timeout=IDLE_S + 10)
        # The same pings end the call on a server of gRPC's default policy: what the test above would catch.
        async with grpc.aio.insecure_channel(
            f"127.0.0.1:{default_port}", options=pinging_every(PING_MS)
        ) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await cache_pb2_grpc.CacheStub(channel).Stat(cache_pb2.StatRequest(), timeout=IDLE_S + 10)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, refused.value.details()
    finally:
        await default_server.stop(None)
        await started.stop(None)


async def test_a_planner_client_keeps_grpcs_keepalive_defaults(monkeypatch):
    """A client may reach a proxy or server whose policy refuses frequent pings: its channel pings on none."""
    opened = []
    real = grpc.aio.insecure_channel

    def insecure_channel(address, options, interceptors):
        opened.append(dict(options))
        return real(address, options=options, interceptors=interceptors)

    monkeypatch.setattr(protos.rpc.grpc.aio, "insecure_channel", insecure_channel)
    await PlannerClient("127.0.0.1:1").close()
    [options] = opened
    assert not [name for name in options if "keepalive" in name or "ping" in name], options
    assert options == dict(CHANNEL_OPTIONS)
