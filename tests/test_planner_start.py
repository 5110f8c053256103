"""`deltaserve planner` against an executor that answered its health check, then hung before the planner
attached (a process frozen, a host paused): the attach waits for it, and a stop signal still ends the planner.
It used to wait in the attach for ever, a first SIGTERM unheard. A start that ends part way (that stop, or a
mistake, a TLS key unreadable) closes what it opened: the engines started, the executors' channels."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry, Gauge

from deltaserve import cli
from planner_svc.config import PlannerConfig
from planner_svc.link import GrpcLink
from planner_svc.server import start_planner_server
from protos import executor_pb2, executor_pb2_grpc
from protos.layout import RowLayout
from protos.rpc import ServerSecurity
from protos.tls import ServerTLS, TLSConfigError

pytestmark = pytest.mark.asyncio(loop_scope="session")


class HungExecutor(executor_pb2_grpc.ExecutorServicer):
    """Healthy by its health service; its Describe never answers (`asked` once it is called)."""

    def __init__(self) -> None:
        self.asked = asyncio.Event()

    async def Describe(self, request, context):
        self.asked.set()
        await asyncio.Event().wait()


class AnsweringExecutor(executor_pb2_grpc.ExecutorServicer):
    """Describes a small executor of SmolLM2's vocabulary; its step stream answers nothing, and says when it
    ends (`streams_ended`)."""

    def __init__(self) -> None:
        self.described = asyncio.Event()
        self.streams_ended = 0

    async def Describe(self, request, context):
        self.described.set()
        layout = RowLayout.build([4], 256, 16, 64)
        return executor_pb2.ExecutorDescription(
            model_name="stand-in",
            model_fingerprint="stand-in",
            vocab_size=49152,
            max_seq_len=256,
            num_layers=1,
            page_size=16,
            pool_pages=64,
            buckets=[4],
            slots=layout.slots,
            block_span=layout.block_span,
            device="cpu",
            layer_end=1,
            eos_token_ids=[2],
        )

    async def Steps(self, request_iterator, context):
        try:
            async for _ in request_iterator:
                pass
            await asyncio.Event().wait()
        finally:
            self.streams_ended += 1


async def serve(executor: executor_pb2_grpc.ExecutorServicer) -> tuple[grpc.aio.Server, int]:
    """`executor` on a free loopback port, its health service saying SERVING."""
    server = grpc.aio.server()
    executor_pb2_grpc.add_ExecutorServicer_to_server(executor, server)
    healthy = health.aio.HealthServicer()
    await healthy.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(healthy, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port


def engine_tasks(links: list[GrpcLink]) -> list[asyncio.Task]:
    """The engine tasks of these links still alive (another module's stack may run its own in this loop)."""
    names = {f"engine {link.address}" for link in links}
    return [task for task in asyncio.all_tasks() if task.get_name() in names]


async def test_a_planner_attaching_to_a_hung_executor_stops_when_told():
    executor = HungExecutor()
    server, port = await serve(executor)
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


async def test_a_start_cancelled_while_attaching_closes_the_executors_channels():
    """Two executors, the first described, the second never answering: the stop signal's cancel closes both
    channels (the first's used to be left open)."""
    answering, hung = AnsweringExecutor(), HungExecutor()
    servers = [await serve(answering), await serve(hung)]
    links = [GrpcLink(f"127.0.0.1:{port}") for _, port in servers]
    try:
        config = PlannerConfig(executors=[link.address for link in links])
        start = asyncio.ensure_future(start_planner_server(config, links=links))
        await asyncio.wait_for(hung.asked.wait(), 60)
        assert answering.described.is_set()
        start.cancel()
        with pytest.raises(asyncio.CancelledError):
            await start
        shut = [link._channel.get_state() for link in links]
        assert shut == [grpc.ChannelConnectivity.SHUTDOWN] * 2
    finally:
        for server, _ in servers:
            await server.stop(None)


@pytest.mark.parametrize("fault", ["metrics", "tls"])
async def test_a_start_failing_after_its_engines_started_stops_them(tmp_path, fault):
    """A start that fails once its engines run stops them: their tasks end and the executors see their step
    streams close. Its metrics cannot be registered, or its TLS key cannot be read (read as the port is
    bound: it used to leave the engines running)."""
    executors = [AnsweringExecutor(), AnsweringExecutor()]
    servers = [await serve(executor) for executor in executors]
    links = [GrpcLink(f"127.0.0.1:{port}") for _, port in servers]
    registry, security = CollectorRegistry(), None
    if fault == "metrics":
        Gauge("deltaserve_requests_running", "taken already", registry=registry)
        failure: tuple[type[Exception], str] = (ValueError, "Duplicated")
    else:
        security = ServerSecurity(tls=ServerTLS(str(tmp_path / "no.crt"), str(tmp_path / "no.key")))
        failure = (TLSConfigError, "cannot read the TLS key")
    try:
        config = PlannerConfig(executors=[link.address for link in links])
        with pytest.raises(failure[0], match=failure[1]):
            await start_planner_server(config, links=links, metrics=registry, security=security)
        assert engine_tasks(links) == []
        assert [link._channel.get_state() for link in links] == [grpc.ChannelConnectivity.SHUTDOWN] * 2
        for _ in range(100):  # the executors hear of the cancel over the wire
            if all(executor.streams_ended for executor in executors):
                break
            await asyncio.sleep(0.05)
        assert [executor.streams_ended for executor in executors] == [1, 1]
    finally:
        for server, _ in servers:
            await server.stop(None)
