"""The HTTP API of a serving command (`up --http-port`, `http`): in the command's own process, or in processes
of their own (deltaserve/http_process.py)."""

from __future__ import annotations

import argparse
import contextlib

from prometheus_client import CollectorRegistry

from protos.rpc import ChannelSecurity


async def start_http_api(
    servers: contextlib.AsyncExitStack,
    planner_addr: str,
    args: argparse.Namespace,
    port: int,
    link: ChannelSecurity,
    metrics: CollectorRegistry | None,
    *,
    processes: int,
) -> int:
    """Starts the HTTP API (to be stopped with `servers`) over the planner at planner_addr, reached over
    `link`, HTTPS with the process's own TLS, in this process (processes=0) or that many of its own
    (http_process.py; several share the port); returns its port."""
    # FastAPI and uvicorn: only the commands serving HTTP import them.
    from gateway_svc.http_metrics import count_into

    count = count_into(metrics) if metrics is not None else None
    reasoning_field = None if args.reasoning_field == "none" else args.reasoning_field
    if processes:
        from deltaserve.http_process import GatewaySpec, start_gateway_process
        from gateway_svc.http_server import check_free

        if processes > 1 and port:
            check_free(args.host, port)

        for _ in range(processes):
            spec = GatewaySpec(
                planner_addr,
                args.host,
                port,
                link,
                args.trust.server.tls,
                metrics is not None,
                processes > 1,
                args.log_level,
                args.log_json,
                args.command,  # its lines' service: up or http, as the parent's
                reasoning_field,
            )
            process = await start_gateway_process(spec, count)
            servers.push_async_callback(process.stop)
            port = process.port  # the first's, when it picked a free one
        return port
    from gateway_svc.http_server import start_gateway

    started = await start_gateway(
        planner_addr,
        args.host,
        port,
        planner_channel=link,
        tls=args.trust.server.tls,
        count=count,
        reasoning_field=reasoning_field,
    )
    servers.push_async_callback(started.stop)
    return started.port
