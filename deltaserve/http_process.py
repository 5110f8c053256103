"""`up`'s HTTP API in a process of its own (spawned, not forked: the parent runs gRPC and maybe CUDA). Every
streamed token is an SSE event the gateway relays and encodes (~41k events/s at 256 streams on an H200);
on the planner's event loop that work delays its steps, in its own process it runs on another core. Its
answers are still counted in the parent's metrics registry: the child sends (path, status) per answer."""

from __future__ import annotations

import asyncio
import multiprocessing
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import structlog

from gateway_svc.http_metrics import Count
from protos.rpc import ChannelSecurity
from protos.tls import ServerTLS

log = structlog.get_logger("deltaserve.gateway")

START_TIMEOUT_S = 120  # the child imports FastAPI, uvicorn and grpc before it listens
STOP_TIMEOUT_S = 10  # the child's own grace (http_server.STOP_GRACE_S) and its exit


@dataclass(frozen=True, slots=True)
class GatewaySpec:
    """What the child needs (picklable): the planner, where to listen, TLS on both sides, its logging."""

    planner_addr: str
    host: str
    port: int
    link: ChannelSecurity
    tls: ServerTLS | None
    counted: bool  # send each answer's (path, status) to the parent's metrics
    reuse_port: bool  # one of several workers on the port
    log_level: str
    log_json: bool | None


def _child(spec: GatewaySpec, conn: Connection) -> None:
    from deltaserve import aio
    from deltaserve.logs import configure_logging

    configure_logging(spec.log_level, spec.log_json, route_transformers=False, service="up")
    aio.run(lambda stop: _serve(spec, conn, stop))  # uvloop, as every deltaserve process


async def _serve(spec: GatewaySpec, conn: Connection, stop: asyncio.Event) -> None:
    from gateway_svc.http_server import start_gateway

    loop = asyncio.get_running_loop()
    loop.add_reader(conn.fileno(), stop.set)  # the parent never writes: readable means it is gone
    count = (lambda path, status: conn.send((path, status))) if spec.counted else None
    try:
        started = await start_gateway(
            spec.planner_addr,
            spec.host,
            spec.port,
            planner_channel=spec.link,
            tls=spec.tls,
            count=count,
            reuse_port=spec.reuse_port,
        )
    except BaseException as error:
        conn.send(("failed", str(error)))
        raise
    conn.send(("port", started.port))
    await stop.wait()
    loop.remove_reader(conn.fileno())
    await started.stop()


@dataclass(slots=True)
class GatewayProcess:
    port: int
    process: multiprocessing.process.BaseProcess
    conn: Connection

    async def stop(self) -> None:
        """SIGTERM: the child stops listening and gives open streams their grace, then exits."""
        self.process.terminate()
        await asyncio.to_thread(self.process.join, STOP_TIMEOUT_S)
        if self.process.is_alive():
            self.process.kill()
            await asyncio.to_thread(self.process.join)
        asyncio.get_running_loop().remove_reader(self.conn.fileno())
        self.conn.close()


async def start_gateway_process(spec: GatewaySpec, count: Count | None) -> GatewayProcess:
    """The child started and listening (its port known), its answers counted with `count` (with
    spec.counted); OSError saying why it did not start."""
    ours, theirs = multiprocessing.Pipe()  # duplex: the child sees the parent go
    process = multiprocessing.get_context("spawn").Process(
        target=_child, args=(spec, theirs), name="deltaserve-http", daemon=True
    )
    process.start()
    theirs.close()
    ready = await asyncio.to_thread(ours.poll, START_TIMEOUT_S)
    message: tuple[str, Any] = ours.recv() if ready else ("failed", f"no answer in {START_TIMEOUT_S} s")
    if message[0] != "port":
        process.kill()
        process.join()
        raise OSError(f"the HTTP API's process did not start: {message[1]}")

    def counted() -> None:  # on the parent's loop: one message per answer, never per token
        try:
            while ours.poll():
                path, status = ours.recv()
                if count is not None:
                    count(path, status)
        except EOFError:
            asyncio.get_running_loop().remove_reader(ours.fileno())

    asyncio.get_running_loop().add_reader(ours.fileno(), counted)
    return GatewayProcess(message[1], process, ours)
