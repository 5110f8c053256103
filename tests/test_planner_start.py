"""`deltaserve planner` against an executor that answered its health check, then hung before the planner
attached (a process frozen, a host paused): the attach waits for it, and a stop signal still ends the planner.
It used to wait in the attach for ever, a first SIGTERM unheard."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from deltaserve import cli
from protos import executor_pb2_grpc

pytestmark = pytest.mark.asyncio(loop_scope="session")


class HungExecutor(executor_pb2_grpc.ExecutorServicer):
    """Healthy by its health service; its Describe never answers (`asked` once it is called)."""

    def __init__(self) -> None:
        self.asked = asyncio.Event()

    async def Describe(self, request, context):
        self.asked.set()
        await asyncio.Event().wait()


async def test_a_planner_attaching_to_a_hung_executor_stops_when_told():
    server = grpc.aio.server()
    executor = HungExecutor()
    executor_pb2_grpc.add_ExecutorServicer_to_server(executor, server)
    healthy = health.aio.HealthServicer()
    await healthy.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(healthy, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        args = cli.parse_args(["planner", "--executor", f"127.0.0.1:{port}", "--port", "0"], environ={})
        stop = asyncio.Event()
        planner = asyncio.ensure_future(cli._serving(args)(stop))
        await asyncio.wait_for(executor.asked.wait(), 60)  # past the health check, into the attach
        assert not planner.done()
        stop.set()
        assert await asyncio.wait_for(planner, 5) == 0
    finally:
        await server.stop(None)
