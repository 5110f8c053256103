"""What the commands run on: JSON log lines carrying the bound request id, the event loop runner and its
signals, and the waits for a service to be healthy (the client's, the planner's for its executor)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal

import grpc
import pytest
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from deltaserve import aio
from deltaserve.logs import configure_logging, get_logger
from deltaserve.serve import wait_for_executor
from planner_svc.client import PlannerClient
from protos.rpc import wait_serving
from tests.cli_helpers import free_port

# ---- logging ----


def test_json_lines_carry_the_bound_request_id(capsys, restore_logging):
    configure_logging("info", json=True, route_transformers=False, service="planner")
    log = get_logger("tests.cli")
    with structlog.contextvars.bound_contextvars(request_id="req-7"):
        log.info("token streamed", tokens=3)
        logging.getLogger("tests.stdlib").warning("from %s", "stdlib")
    log.debug("below the level")
    logging.getLogger("grpc").info("grpc chatter below WARNING")
    lines = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    assert [line["event"] for line in lines] == ["token streamed", "from stdlib"]
    assert all(line["request_id"] == "req-7" and "timestamp" in line for line in lines)
    assert all(line["service"] == "planner" for line in lines)
    assert (lines[0]["level"], lines[0]["logger"], lines[0]["tokens"]) == ("info", "tests.cli", 3)
    assert (lines[1]["level"], lines[1]["logger"]) == ("warning", "tests.stdlib")
    with pytest.raises(ValueError, match="unknown log level"):
        configure_logging("loud")


# ---- the event loop runner ----


def test_run_returns_the_result_and_a_signal_sets_stop():
    async def main_coro(stop: asyncio.Event) -> str:
        os.kill(os.getpid(), signal.SIGTERM)
        await asyncio.wait_for(stop.wait(), timeout=5)
        return "stopped cleanly"

    assert aio.run(main_coro) == "stopped cleanly"
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # handlers removed again


# ---- waiting for a service to be healthy ----


async def start_health_server(status) -> tuple[grpc.aio.Server, health.aio.HealthServicer, str]:
    server = grpc.aio.server()
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    await servicer.set("", status)
    return server, servicer, f"127.0.0.1:{port}"


async def test_wait_serving_waits_for_serving():
    server, servicer, addr = await start_health_server(health_pb2.HealthCheckResponse.NOT_SERVING)
    try:
        async with grpc.aio.insecure_channel(addr) as channel:
            with pytest.raises(TimeoutError, match="NOT_SERVING"):
                await wait_serving(channel, 0.5)
            asyncio.get_running_loop().call_later(
                0.3, asyncio.ensure_future, servicer.set("", health_pb2.HealthCheckResponse.SERVING)
            )
            await wait_serving(channel, 5)
    finally:
        await server.stop(None)


async def test_wait_serving_times_out_on_nothing_listening():
    async with PlannerClient(f"127.0.0.1:{free_port()}") as client:
        with pytest.raises(TimeoutError, match="UNAVAILABLE"):
            await client.wait_ready(0.5)
        assert not client.connected()


async def test_planner_waits_for_executor_until_healthy_or_stopped():
    stop = asyncio.Event()
    asyncio.get_running_loop().call_later(0.3, stop.set)
    assert await wait_for_executor(f"127.0.0.1:{free_port()}", stop) is False
    server, _, addr = await start_health_server(health_pb2.HealthCheckResponse.SERVING)
    try:
        assert await wait_for_executor(addr, asyncio.Event()) is True
    finally:
        await server.stop(None)
