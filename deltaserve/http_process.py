"""`up`'s HTTP API in a process of its own (spawned, not forked: the parent runs gRPC and maybe CUDA). Every
streamed token is an SSE event the gateway relays and encodes (~41k events/s at 256 streams on an H200);
on the planner's event loop that work delays its steps, in its own process it runs on another core. Its
answers are still counted in the parent's metrics registry: the child sends (path, status) per answer."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
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
    """What the child needs (picklable): the planner, where to listen, TLS on both sides, its logging (under the
    command that started it: `service` is `up` or `http`)."""

    planner_addr: str
    host: str
    port: int
    link: ChannelSecurity
    tls: ServerTLS | None
    counted: bool  # send each answer's (path, status) to the parent's metrics
    reuse_port: bool  # one of several workers on the port
    log_level: str
    log_json: bool | None
    service: str
    reasoning_field: str | None  # where a chat answer's thought goes, apart from its content (None: not)


def _child(spec: GatewaySpec, conn: Connection) -> None:
    import signal

    from deltaserve import aio
    from deltaserve.logs import configure_logging

    # A terminal's Ctrl-C or hang-up, and a SIGTERM to the whole group (systemd's stop, `kill -- -PGID`), reach
    # this process too: the parent drains (its streams finish through here, for up to --drain-timeout) and then
    # stops this one by a word down its pipe. Stopping at the signal would cut them after STOP_GRACE_S.
    for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    configure_logging(spec.log_level, spec.log_json, route_transformers=False, service=spec.service)
    aio.run(lambda stop: _serve(spec, conn, stop), signals=())  # uvloop, as every process


async def _serve(spec: GatewaySpec, conn: Connection, stop: asyncio.Event) -> None:
    from gateway_svc.http_server import start_gateway

    loop = asyncio.get_running_loop()
    loop.add_reader(conn.fileno(), stop.set)  # readable: the parent said stop, or is gone
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
            reasoning_field=spec.reasoning_field,
        )
    except BaseException as error:
        conn.send(("failed", str(error)))
        raise
    conn.send(("port", started.port))
    await stop.wait()
    loop.remove_reader(conn.fileno())
    with contextlib.suppress(EOFError, OSError):
        while conn.poll():  # the parent's "stop", read: a socket closed with unread bytes resets its peer
            conn.recv()
    await started.stop()


@dataclass(slots=True)
class GatewayProcess:
    """One child serving the HTTP API; one that dies (killed, crashed: a non-zero exit) is logged and started
    again on its port, so the API does not stay down behind a parent that still looks healthy. One that exits
    0 was stopped (the parent's word down its pipe): warned, not restarted."""

    spec: GatewaySpec  # its port the one it listens on
    count: Count | None
    process: multiprocessing.process.BaseProcess
    conn: Connection
    stopping: bool = False
    restarting: asyncio.Task | None = None

    @property
    def port(self) -> int:
        return self.spec.port

    def watch(self) -> None:
        asyncio.get_running_loop().add_reader(self.conn.fileno(), self._read)

    def _read(self) -> None:  # on the parent's loop: one message per answer, never per token
        try:
            while self.conn.poll():
                path, status = self.conn.recv()
                if self.count is not None:
                    self.count(path, status)
        except (EOFError, OSError):  # the child is gone
            loop = asyncio.get_running_loop()
            loop.remove_reader(self.conn.fileno())
            if not self.stopping:
                self.restarting = loop.create_task(self._restart())

    async def _restart(self) -> None:
        await asyncio.to_thread(self.process.join, STOP_TIMEOUT_S)
        self.conn.close()
        if self.stopping:
            return
        if self.process.exitcode == 0:  # stopped, not died
            log.warning("the HTTP API's process stopped (exit 0); not started again", port=self.port)
            return
        log.error("the HTTP API's process exited; starting another", exitcode=self.process.exitcode)
        try:
            self.process, self.conn, _ = await _spawn(self.spec)
        except Exception as error:  # said, never lost in an unread task
            log.error("the HTTP API is down: its process could not be started again", error=repr(error))
            return
        log.info("the HTTP API's process started again", port=self.port)
        self.watch()

    async def stop(self) -> None:
        """A word down its pipe: the child stops listening and gives open streams their grace, then exits (its
        answers meanwhile still counted)."""
        self.stopping = True
        if self.restarting is not None:  # let a restart under way finish: then there is one process to stop
            await asyncio.wait([self.restarting])
        try:
            self.conn.send("stop")
        except OSError:  # it is gone already
            pass
        await asyncio.to_thread(self.process.join, STOP_TIMEOUT_S)
        if self.process.is_alive():
            self.process.kill()
            await asyncio.to_thread(self.process.join)
        if not self.conn.closed:
            asyncio.get_running_loop().remove_reader(self.conn.fileno())
            self.conn.close()


async def _spawn(spec: GatewaySpec) -> tuple[multiprocessing.process.BaseProcess, Connection, int]:
    """A child started and listening, and its port; OSError saying why it did not start."""
    ours, theirs = multiprocessing.Pipe()  # duplex: the child sees the parent go
    process = multiprocessing.get_context("spawn").Process(
        target=_child, args=(spec, theirs), name="deltaserve-http", daemon=True
    )
    process.start()
    theirs.close()
    ready = await asyncio.to_thread(ours.poll, START_TIMEOUT_S)
    try:
        message: tuple[str, Any] = ours.recv() if ready else ("failed", f"no answer in {START_TIMEOUT_S} s")
    except EOFError:  # it died before it listened
        message = ("failed", f"it exited (code {process.exitcode}) before it listened")
    if message[0] != "port":
        process.kill()
        process.join()
        ours.close()
        raise OSError(f"the HTTP API's process did not start: {message[1]}")
    return process, ours, message[1]


async def start_gateway_process(spec: GatewaySpec, count: Count | None) -> GatewayProcess:
    """The child started and listening (its port known), its answers counted with `count` (with
    spec.counted); OSError saying why it did not start."""
    process, conn, port = await _spawn(spec)
    started = GatewayProcess(dataclasses.replace(spec, port=port), count, process, conn)
    started.watch()
    return started
