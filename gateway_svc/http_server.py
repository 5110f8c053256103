"""The gateway served by uvicorn on its own socket, inside a running event loop (`up` serves it beside the
gRPC services; `deltaserve http` alone): started, its port known, and stopped by the caller."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
from dataclasses import dataclass

import structlog
import uvicorn

from gateway_svc.app import create_app
from gateway_svc.http_metrics import Count
from planner_svc.client import PlannerClient
from protos.rpc import ChannelSecurity
from protos.tls import ServerTLS

log = structlog.get_logger("deltaserve.gateway")

STOP_GRACE_S = 5  # streams still open then are cut (each cut aborts its request)
# An idle connection is kept this long (uvicorn's default, 5 s, equals httpx's and the OpenAI SDK's pool
# expiry: a pooled connection the client reuses as the server closes it fails the request with a read
# error; seen at c = 256 on the H200). Longer than clients' pools and load balancers' idle timeouts (60 s).
KEEP_ALIVE_S = 75


class _Server(uvicorn.Server):
    """uvicorn without its signal handlers: the process's own (deltaserve.aio) stop it, draining first."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


@dataclass(slots=True)
class StartedGateway:
    port: int
    server: uvicorn.Server
    task: asyncio.Task
    planner: PlannerClient

    async def stop(self) -> None:
        """Stops listening, gives open streams STOP_GRACE_S, then closes the planner channel."""
        self.server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await self.task
        await self.planner.close()


def _listen(host: str, port: int, reuse_port: bool) -> socket.socket:
    """A listening socket on host:port (0: a free one); OSError naming the port when it does not bind.
    reuse_port: several worker processes listen on the port, the kernel spreads connections over them."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    # as uvicorn's and gRPC's own binds: connections this side closed (at a drain, `Connection: close`) wait out
    # TIME-WAIT on the port for a minute, and a restart would find it "taken"; another listener still is
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as error:
        sock.close()
        raise OSError(
            f"cannot listen on {host}:{port}: port {port} is taken, or {host} is not an address of this "
            f"machine ({error.strerror})"
        ) from error
    sock.listen(2048)
    sock.setblocking(False)
    return sock


def check_free(host: str, port: int) -> None:
    """OSError naming the port where anything listens on it: workers bind it with SO_REUSEPORT, which would
    share it silently with another group of workers (a second `http --workers`) instead of failing."""
    _listen(host, port, reuse_port=False).close()


async def start_gateway(
    planner_addr: str,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    planner_channel: ChannelSecurity | None = None,
    tls: ServerTLS | None = None,
    count: Count | None = None,
    reuse_port: bool = False,
    reasoning_field: str | None = "reasoning",
) -> StartedGateway:
    """Serves the HTTP API on host:port, talking to the planner at planner_addr (`planner_channel`: TLS;
    each caller's key is forwarded per call). `tls`: HTTPS with the services' certificate and key (a
    client CA requires client certificates). `count`: what its answers are counted with. `reasoning_field`:
    a chat answer's thought apart from its content."""
    planner = PlannerClient(planner_addr, planner_channel)
    config = uvicorn.Config(
        create_app(planner, count, reasoning_field=reasoning_field),
        log_config=None,  # deltaserve's structlog configuration stays
        access_log=False,
        lifespan="off",
        timeout_graceful_shutdown=STOP_GRACE_S,
        timeout_keep_alive=KEEP_ALIVE_S,
        ssl_certfile=tls.cert if tls is not None else None,
        ssl_keyfile=tls.key if tls is not None else None,
        ssl_ca_certs=tls.client_ca if tls is not None else None,
        ssl_cert_reqs=ssl.CERT_REQUIRED if tls is not None and tls.client_ca else ssl.CERT_NONE,
    )
    sock = _listen(host, port, reuse_port)
    server = _Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        if task.done():  # failed to start: its error
            await planner.close()
            task.result()
            raise RuntimeError("the HTTP server stopped before it started")
        await asyncio.sleep(0.01)
    bound = sock.getsockname()[1]
    log.info(
        "HTTP API listening",
        address=f"{host}:{bound}",
        planner=planner_addr,
        https=tls is not None,
        reasoning_field=reasoning_field,
    )
    return StartedGateway(bound, server, task, planner)
