"""What bench/decode.py's child processes run, in its hidden modes: the JSON-lines protocol's child side
(protocol_stdout, answer_lines), an executor server (--serve-executor, serve_executor) and the load generator
(--serve-clients, serve_clients) with its timed requests (one_request, RequestResult). The parent's side is
bench/decode_children.py."""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TextIO

import grpc
import numpy as np
import structlog
import torch

import deltaserve.aio
from bench.decode_model import build_runner, executor_config, int_list, random_model
from bench.step_timeline import ExecutorTimeline
from executor_svc.server import start_executor_server
from protos import client_pb2, client_pb2_grpc
from protos.heap import freeze_startup_heap
from protos.rpc import ChannelSecurity, ServerSecurity, open_channel
from protos.tls import ClientTLS, ServerTLS
from protos.wire import pack_i32, unpack_i32


@dataclass
class RequestResult:
    sent: float
    arrivals: list[tuple[float, int]]  # (time, tokens in that message)
    tokens: list[int]
    error: str | None


async def one_request(
    stub: client_pb2_grpc.PlannerStub, prompt: np.ndarray, max_tokens: int
) -> RequestResult:
    request = client_pb2.GenerateRequest(token_ids=pack_i32(prompt), max_tokens=max_tokens, ignore_eos=True)
    sent = time.perf_counter()
    arrivals: list[tuple[float, int]] = []
    tokens: list[int] = []
    try:
        async for response in stub.Generate(request):
            ids = unpack_i32(response.token_ids)
            if len(ids):
                arrivals.append((time.perf_counter(), len(ids)))
                tokens.extend(int(t) for t in ids)
    except grpc.aio.AioRpcError as err:
        return RequestResult(sent, arrivals, tokens, f"{err.code().name}: {err.details()}")
    return RequestResult(sent, arrivals, tokens, None)


def protocol_stdout() -> TextIO:
    """A LineChild's protocol: the real stdout, for its lines only; fd 1 then points at stderr, so anything
    else printed (logs included) goes there."""
    protocol = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    return protocol


async def answer_lines(protocol: TextIO, answer: Callable[[dict], dict], stop: asyncio.Event) -> None:
    """A LineChild's side of `ask`: one answer line per request line on stdin, until stdin closes or a stop
    signal. `answer` runs in a thread of its own (stdin is read blocking); the event loop stays free."""
    loop = asyncio.get_running_loop()
    stdin_closed = asyncio.Event()

    def serve() -> None:
        try:
            for line in sys.stdin:
                protocol.write(json.dumps(answer(json.loads(line))) + "\n")
        finally:  # also when an answer raised: its traceback is on stderr, and the process exits
            # (the parent's `ask` then fails with that stderr's tail, rather than waiting for its timeout)
            loop.call_soon_threadsafe(stdin_closed.set)

    threading.Thread(target=serve, daemon=True).start()
    await deltaserve.aio.until_stopped(stdin_closed.wait(), stop)


async def serve_executor(args: argparse.Namespace, stop: asyncio.Event) -> None:
    """The child's side of ExecutorChild: builds the arm's runner, serves it, answers `times` until stdin
    closes."""
    protocol = protocol_stdout()
    buckets = int_list(args.buckets)
    config = executor_config(
        args.device, args.pool_pages, buckets, args.serve_executor, int_list(args.prefill_buckets)
    )
    runner, states = build_runner(
        random_model(torch.device(args.device), args.model_shape), config, args.model_shape
    )
    if runner is None:
        protocol.write(json.dumps(states) + "\n")
        return
    tls = ServerTLS(args.tls_cert, args.tls_key) if args.tls_cert else None
    server = await start_executor_server(runner, security=ServerSecurity(tls=tls))
    protocol.write(json.dumps({"port": server.port, "capture": states}) + "\n")
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    freeze_startup_heap()  # as `deltaserve executor` does once serving
    timeline = ExecutorTimeline(runner) if args.serve_timeline else None

    def answer(request: dict) -> dict:
        """{"times": true} or {"timeline": true}: the runner's floats and notes are safe to read from
        answer_lines' thread."""
        if request.get("timeline"):
            return {"steps": timeline.take() if timeline else []}
        return asdict(runner.times)

    await answer_lines(protocol, answer, stop)
    await server.stop(None)


async def serve_clients(stop: asyncio.Event) -> None:
    """The child's side of ClientsChild: runs each measurement's requests at once, against the planner named
    (one channel per planner, kept for the run)."""
    protocol = protocol_stdout()
    loop = asyncio.get_running_loop()
    stubs: dict[str, client_pb2_grpc.PlannerStub] = {}
    channels: list[grpc.aio.Channel] = []

    async def generate(request: dict) -> dict:
        address, trust = request["address"], request.get("security") or {}
        if address not in stubs:
            tls = ClientTLS(ca=trust["ca"]) if trust.get("ca") else None
            channels.append(open_channel(address, ChannelSecurity(tls=tls, api_key=trust.get("api_key"))))
            stubs[address] = client_pb2_grpc.PlannerStub(channels[-1])
        prompts = [np.asarray(p, dtype=np.int32) for p in request["prompts"]]
        paused.clear()
        began = time.perf_counter()
        results = await asyncio.gather(
            *(one_request(stubs[address], p, request["max_tokens"]) for p in prompts)
        )
        wall = time.perf_counter() - began  # this process's clock, as the arrivals'
        return {"results": [asdict(r) for r in results], "wall": wall, "gc_ms": round(sum(paused) * 1e3, 2)}

    # The collector's pauses in this process during a measurement: they stretch its wall, not the service's.
    paused: list[float] = []
    started = [0.0]

    def note_collection(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            paused.append(time.perf_counter() - started[0])

    gc.callbacks.append(note_collection)
    freeze_startup_heap()  # as the services' processes do
    protocol.write(json.dumps({"ready": True}) + "\n")
    # The requests run on the event loop; answer_lines' thread waits for each measurement's lot.
    await answer_lines(
        protocol, lambda request: asyncio.run_coroutine_threadsafe(generate(request), loop).result(), stop
    )
    for channel in channels:
        await channel.close()
