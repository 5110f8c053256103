"""The gRPC floor below every service: channel options, a health wait, and one way to start a server.

A server starts with the standard health service (SERVING for "" and its own services once it listens),
reflection, and a checked bind without port reuse: a port that is taken is an error naming it, not a
second server silently sharing it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from protos.auth import ApiKeyInterceptor, ApiKeys, Refused, bearer_interceptors
from protos.tls import ClientTLS, ServerTLS

# One limit for every channel and server. 64 MiB: the largest of the three the services had (the cache
# had 16 MiB), so nothing that passed before is refused now. What comes near it: a cache header or a
# restore reply carrying a long conversation's token ids (4 bytes a token), and a row-check mirror of
# every row a wide step reads. Snapshot bytes stream in chunks of a few MiB, far below it.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# A client's channel (PlannerClient, the gateway's, the CLI's) keeps gRPC's keepalive defaults: it may reach a
# server or proxy of another ping policy, whose default answers pings more often than every 5 minutes with
# GOAWAY "too_many_pings", ending a long call. A client bounds a hung planner by its call's deadline.
# Its reconnects back off to at most RECONNECT_MAX_MS apart (gRPC's default grows to 120 s): a gateway or client
# started before its planner, or outliving a restart of it, would answer UNAVAILABLE for up to two minutes after
# the planner was back (10 s after an outage of 60 s, 22 s after one of 150 s).
RECONNECT_MAX_MS = 1000
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.initial_reconnect_backoff_ms", RECONNECT_MAX_MS),
    ("grpc.max_reconnect_backoff_ms", RECONNECT_MAX_MS),
]
# Between one deployment's own services (the planner's step streams and calls to its executors, planner and
# executors to the cache), whose servers take these pings: a peer that stops answering (SIGSTOP, a frozen VM, a
# cable pulled) leaves its TCP connection open, and a call on it waited forever (a park, a restore or a drain
# behind a hung cache). While a call is open the channel pings every INTERNAL_KEEPALIVE_MS (gRFC A8's floor),
# and a ping not answered within INTERNAL_KEEPALIVE_TIMEOUT_MS closes the connection: its calls end UNAVAILABLE.
# gRPC's core answers pings off the Python thread, so a busy peer (a long prefill) still answers them.
INTERNAL_KEEPALIVE_MS = 10_000
INTERNAL_KEEPALIVE_TIMEOUT_MS = 10_000
INTERNAL_CHANNEL_OPTIONS = [
    *CHANNEL_OPTIONS,
    ("grpc.keepalive_time_ms", INTERNAL_KEEPALIVE_MS),
    ("grpc.keepalive_timeout_ms", INTERNAL_KEEPALIVE_TIMEOUT_MS),
    # The same bound for a ping stuck behind writes the peer does not take (its window full): 1 minute else.
    ("grpc.http2.ping_timeout_ms", INTERNAL_KEEPALIVE_TIMEOUT_MS),
    ("grpc.http2.max_pings_without_data", 0),  # a call awaiting a long answer sends no data, and pings on
]
# A server binds its port alone: with SO_REUSEPORT two servers could listen on one port and split the
# connections between them. It takes the internal links' pings however long it sends nothing (a long Put).
SERVER_OPTIONS = [
    *CHANNEL_OPTIONS,
    ("grpc.so_reuseport", 0),
    ("grpc.http2.min_ping_interval_without_data_ms", INTERNAL_KEEPALIVE_MS),
    ("grpc.http2.max_ping_strikes", 0),
]

# Metadata of a Steps stream: the opening planner's id (one per planner process), so that a newer stream of the
# same planner replaces one the planner gave up on, and another planner's is refused.
PLANNER_ID_METADATA = "deltaserve-planner-id"
# Trailing metadata of a RESOURCE_EXHAUSTED that a retry cannot mend (a request larger than the pool): the
# gateway answers it 400, not 429 with Retry-After, which OpenAI's client would retry.
NEVER_FITS_METADATA = "deltaserve-never-fits"
# Statuses that mean "not up yet": keep polling.
_NOT_YET = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)

Servicer = TypeVar("Servicer")


@dataclass(frozen=True, slots=True)
class ChannelSecurity:
    """How a client reaches a server: TLS (None: plaintext) and the API key it sends (None: none)."""

    tls: ClientTLS | None = None
    api_key: str | None = None


@dataclass(frozen=True, slots=True)
class ServerSecurity:
    """What a server asks of its callers: TLS (None: plaintext) and API keys (None: the API is open)."""

    tls: ServerTLS | None = None
    keys: ApiKeys | None = None


def open_channel(
    address: str, security: ChannelSecurity | None = None, *, options: Sequence = CHANNEL_OPTIONS
) -> grpc.aio.Channel:
    """The one way a deltaserve client opens a channel: secure or plaintext, with its key or without."""
    security = security or ChannelSecurity()
    interceptors = bearer_interceptors(security.api_key) if security.api_key else None
    if security.tls is not None:
        return grpc.aio.secure_channel(
            address, security.tls.credentials(), options=list(options), interceptors=interceptors
        )
    return grpc.aio.insecure_channel(address, options=list(options), interceptors=interceptors)


async def wait_serving(
    channel: grpc.aio.Channel, timeout: float, *, service: str = "", poll_s: float = 0.2
) -> None:
    """Polls the standard gRPC health service until it answers SERVING.

    Raises TimeoutError (saying what was last seen) when `timeout` seconds pass first, and the
    grpc.aio.AioRpcError itself for errors other than "not up yet" (UNIMPLEMENTED: no health service).
    """
    stub = health_pb2_grpc.HealthStub(channel)
    deadline = time.monotonic() + timeout
    last_seen = "no answer"
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"not serving after {timeout:g} s ({last_seen})")
        try:
            reply = await stub.Check(
                health_pb2.HealthCheckRequest(service=service), timeout=min(remaining, 2.0)
            )
        except grpc.aio.AioRpcError as error:
            if error.code() not in _NOT_YET:
                raise
            last_seen = f"{error.code().name}: {error.details()}"
        else:
            if reply.status == health_pb2.HealthCheckResponse.SERVING:
                return
            last_seen = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
        await asyncio.sleep(min(poll_s, max(0.0, deadline - time.monotonic())))


@dataclass(slots=True)
class StartedServer(Generic[Servicer]):
    """A server that listens: its bound port, its servicer, its health service, and what its stop closes."""

    server: grpc.aio.Server
    port: int  # the port bound (the one asked for, or the free one picked for port 0)
    servicer: Servicer
    health: health.aio.HealthServicer
    services: tuple[str, ...]  # the full names of the services it serves (health and reflection aside)
    on_stop: list[Callable[[], Awaitable[None]]] = field(default_factory=list)  # run after the server stops

    async def set_serving(self, serving: bool) -> None:
        """What health says for "" and each of the server's services."""
        status = (
            health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ("", *self.services):
            await self.health.set(name, status)

    async def stop(self, grace: float | None = None) -> None:
        """Stops the server (in-flight calls get `grace` seconds), then closes what it used, in order."""
        await self.server.stop(grace)
        for close in self.on_stop:
            await close()

    async def wait_for_termination(self) -> None:
        await self.server.wait_for_termination()


async def start_server(
    servicer: Servicer,
    add_to_server: Callable[[Servicer, grpc.aio.Server], None],
    services: Sequence[str],
    host: str,
    port: int,
    *,
    on_stop: Sequence[Callable[[], Awaitable[None]]] = (),
    security: ServerSecurity | None = None,
    on_refused: Refused | None = None,
) -> StartedServer[Servicer]:
    """Serves `servicer` (registered by its generated `add_..._to_server`), health and reflection on
    host:port (0: any free port), and says SERVING for "" and each of `services` once it listens.

    A port that does not bind (taken by another server, or an address not of this machine) raises OSError
    naming it, TLS files that cannot be read TLSConfigError; nothing is left listening then, and `on_stop` has
    run (what the caller opened is closed). With `security`: TLS on the port, and API keys checked by an
    interceptor (health and reflection open), which tells `on_refused` of each call it refuses.
    """
    security = security or ServerSecurity()
    interceptors = [ApiKeyInterceptor(security.keys, on_refused)] if security.keys is not None else None
    server = grpc.aio.server(options=SERVER_OPTIONS, interceptors=interceptors)
    add_to_server(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((*services, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    started = StartedServer(server, 0, servicer, health_servicer, tuple(services), list(on_stop))
    try:
        # The key and certificate are read here, inside the try: a file unreadable closes what the caller opened.
        credentials = security.tls.credentials() if security.tls is not None else None
        started.port = _bind(server, host, port, credentials)
        await server.start()
    except BaseException:
        await started.stop(None)
        raise
    await started.set_serving(True)
    return started


def _bind(
    server: grpc.aio.Server, host: str, port: int, credentials: grpc.ServerCredentials | None = None
) -> int:
    """The port bound on host:port; OSError naming the port when it does not bind."""
    address = f"{host}:{port}"
    why = f"cannot listen on {address}: port {port} is taken, or {host} is not an address of this machine"
    try:
        if credentials is None:
            bound = server.add_insecure_port(address)
        else:
            bound = server.add_secure_port(address, credentials)
    except RuntimeError as error:  # grpcio raises here where older versions returned 0
        raise OSError(why) from error
    if bound == 0:
        raise OSError(why)
    return bound


def log_access(logger, security: ServerSecurity | None) -> None:
    """Says how a server's API is guarded: TLS or not, and API keys or open (a warning). Never a key."""
    security = security or ServerSecurity()
    tls = security.tls
    transport = "plaintext" if tls is None else ("mTLS" if tls.client_ca else "TLS")
    if security.keys is None:
        logger.warning(
            "API open: no --api-keys; every caller is trusted, one local tenant", transport=transport
        )
    else:
        logger.info(
            "API keys required", keys=len(security.keys), tenants=security.keys.tenants, transport=transport
        )
