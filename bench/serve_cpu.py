"""End-to-end decode tokens/s through the planner, over gRPC to the executor and over an in-process link.

    python bench/serve_cpu.py [--device cpu] [--concurrency 1,8] [--max-tokens 64] [--out docs/bench/serve_cpu.json]

Both arms serve the same model (a runner each), alternated, two rounds each, so the gRPC hop's cost
is the difference. Greedy, ignore_eos, a short chat prompt per request.

    python bench/serve_cpu.py --side-by-side [--concurrency 1,4] [--llamacpp-python PYTHON] [--rounds 2]
        [--baseline-decode-steps 1]

deltaserve against transformers `generate` and llama.cpp on the same GGUF, 28- and 512-token prompts, and the
executor's resident memory packed vs de-quantized (bench/cpu_side_by_side.py).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import commit_hash, write_json
from bench.in_process import InProcessLink
from executor_svc.config import ExecutorConfig
from executor_svc.runner import build_runner
from executor_svc.server import start_executor_server
from planner_svc.client import GenerateOptions, PlannerClient
from planner_svc.config import PlannerConfig
from planner_svc.link import GrpcLink
from planner_svc.server import start_planner_server
from protos.rpc import StartedServer

PROMPT = [{"role": "user", "content": "Tell me a long story about a lighthouse keeper and the sea."}]


async def run_arm(addr: str, concurrency: int, max_tokens: int) -> dict:
    async with PlannerClient(addr) as client:
        await client.generate_all(GenerateOptions(chat=PROMPT, max_tokens=4))  # warm-up
        began = time.perf_counter()
        results = await asyncio.gather(
            *(
                client.generate_all(GenerateOptions(chat=PROMPT, max_tokens=max_tokens, ignore_eos=True))
                for _ in range(concurrency)
            )
        )
        elapsed = time.perf_counter() - began
    tokens = sum(len(r.token_ids) for r in results)
    return {"tok_s": tokens / elapsed, "tokens": tokens, "seconds": elapsed}


async def main_async(args) -> list[dict]:
    # One runner per arm: an executor's tables and pool belong to the one planner that drives it.
    config = ExecutorConfig(device=args.device, pool_pages=1024, buckets=(1, 2, 4, 8, 16))
    grpc_runner, local_runner = [await asyncio.to_thread(build_runner, config) for _ in range(2)]
    executor_server = await start_executor_server(grpc_runner)
    arms = {}
    servers: list[StartedServer[Any]] = [executor_server]  # the executor and each arm's planner
    links = (
        ("grpc", GrpcLink(f"127.0.0.1:{executor_server.port}")),
        ("in-process", InProcessLink(local_runner)),
    )
    for arm, link in links:
        server = await start_planner_server(PlannerConfig(), port=0, links=[link])
        servers.append(server)
        arms[arm] = f"127.0.0.1:{server.port}"
    results = []
    commit = commit_hash()
    for concurrency in args.concurrency:
        rounds: dict[str, list[float]] = {arm: [] for arm in arms}
        for _ in range(2):  # alternated, two rounds each
            for arm, addr in arms.items():
                rounds[arm].append((await run_arm(addr, concurrency, args.max_tokens))["tok_s"])
        for arm, values in rounds.items():
            result = {
                "arm": arm,
                "concurrency": concurrency,
                "tok_s": round(statistics.mean(values), 1),
                "rounds": [round(v, 1) for v in values],
                "max_tokens": args.max_tokens,
                "device": args.device,
                "commit": commit,
                "host": platform.node(),
            }
            results.append(result)
            print(
                f"{arm:10s} c={concurrency:3d}  {result['tok_s']:8.1f} tok/s  rounds {result['rounds']}",
                flush=True,
            )
    for server in reversed(servers):
        await server.stop(None)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--out", default=None, help="default docs/bench/serve_cpu[_side_by_side].json")
    parser.add_argument("--side-by-side", action="store_true", help="against transformers and llama.cpp")
    parser.add_argument("--llamacpp-python", help="side by side: a python with llama-cpp-python installed")
    parser.add_argument("--rounds", type=int, default=2, help="side by side: interleaved rounds")
    parser.add_argument("--weights", default="auto", help="side by side: the executor's --weights")
    parser.add_argument(
        "--baseline-decode-steps",
        type=int,
        help="side by side: deltaserve again with its planner at this --decode-steps (1: a plan a token)",
    )
    parser.add_argument(
        "--threads", type=int, default=os.cpu_count() or 1, help="side by side: threads per arm"
    )
    args = parser.parse_args()
    if args.side_by_side:
        from bench.cpu_side_by_side import side_by_side

        results = asyncio.run(side_by_side(args))
        write_json(args.out or "docs/bench/serve_cpu_side_by_side.json", results)
    else:
        results = asyncio.run(main_async(args))
        write_json(args.out or "docs/bench/serve_cpu.json", results)


if __name__ == "__main__":
    main()
