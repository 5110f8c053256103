"""Resume a long conversation from a checkpoint, from a parked snapshot, and by reading it all again.

    python bench/resume.py [--tokens 8000] [--device cpu] [--out docs/bench/resume.json]

A conversation of about --tokens tokens is built turn by turn, then its next turn is timed three ways
in one run: mounted from the pool's retained checkpoint, restored from the cache after a park, and read
in full (no conversation). Reports time to first token and prompt tokens read for each.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import commit_hash, write_json
from cache_svc.server import start_cache_server
from executor_svc.config import ExecutorConfig
from executor_svc.runner import build_runner
from executor_svc.server import start_executor_server
from planner_svc.config import PlannerConfig, SchedulingConfig
from planner_svc.server import start_planner_server
from protos import client_pb2, client_pb2_grpc
from protos.wire import unpack_i32

PARAGRAPH = (
    "The lighthouse keeper wrote in the log every evening: the wind, the ships that passed, the colour of "
    "the sea, and what the gulls were doing. "
)


def chat_request(messages, conversation: str, max_tokens: int) -> client_pb2.GenerateRequest:
    return client_pb2.GenerateRequest(
        chat=client_pb2.ChatMessages(messages=[client_pb2.ChatMessage(**m) for m in messages]),
        max_tokens=max_tokens,
        conversation_id=conversation,
        ignore_eos=True,
    )


async def timed(stub, request) -> dict:
    began = time.perf_counter()
    first: float | None = None
    last: client_pb2.GenerateResponse | None = None
    tokens: list[int] = []
    async for response in stub.Generate(request):
        tokens += unpack_i32(response.token_ids).tolist()
        if first is None and tokens:
            first = time.perf_counter() - began
        last = response
    # Each request here asks for a token or more with ignore_eos: a stream that ends without error had one.
    assert first is not None and last is not None
    return {
        "ttft_s": round(first, 3),
        "prompt_tokens": last.prompt_tokens,
        "read_tokens": last.read_tokens,
        "reused_tokens": last.reused_tokens,
        "checkpoint": last.checkpoint,
        "tokens": tokens,
    }


async def main_async(args) -> list[dict]:
    cache_dir = tempfile.mkdtemp(prefix="deltaserve-resume-")
    cache = await start_cache_server(cache_dir, budget_bytes=16 << 30)
    cache_addr = f"127.0.0.1:{cache.port}"
    pool_pages = args.tokens // 16 * 3 + 64
    runner = await asyncio.to_thread(
        build_runner,
        ExecutorConfig(device=args.device, pool_pages=pool_pages, buckets=(1, 2, 4), cache=cache_addr),
    )
    executor = await start_executor_server(runner, cache=cache_addr)
    planner = await start_planner_server(
        # Prefix sharing off: the full-read arm must read the whole prompt, not the conversation's pages.
        PlannerConfig(
            executors=[f"127.0.0.1:{executor.port}"],
            cache=cache_addr,
            scheduling=SchedulingConfig(prefix_cache=False),
        ),
        port=0,
    )
    import grpc

    channel = grpc.aio.insecure_channel(f"127.0.0.1:{planner.port}")
    stub = client_pb2_grpc.PlannerStub(channel)
    tokenizer = planner.servicer.tokenizer
    messages = [{"role": "system", "content": "You keep a lighthouse log."}]
    turn = 0
    while len(tokenizer.apply_chat_template(messages)["input_ids"]) < args.tokens:
        turn += 1
        messages.append({"role": "user", "content": f"Day {turn}. " + PARAGRAPH * 12})
        await timed(stub, chat_request(messages, "long", 1))
        messages.append({"role": "assistant", "content": "Noted."})
        print(f"turn {turn}: {len(tokenizer.apply_chat_template(messages)['input_ids'])} tokens", flush=True)
    messages.append({"role": "user", "content": "What did the gulls do on the last day?"})
    commit = args.commit or commit_hash()
    results = []
    checkpoint = await timed(stub, chat_request(messages, "long", 8))
    full = await timed(stub, chat_request(messages, "", 8))
    await stub.Park(client_pb2.ParkRequest(conversation_id="long"))
    messages.append({"role": "assistant", "content": "They circled."})
    messages.append({"role": "user", "content": "And the ships?"})
    snapshot = await timed(stub, chat_request(messages, "long", 8))
    full_after = await timed(stub, chat_request(messages, "", 8))
    for arm, result in (
        ("checkpoint", checkpoint),
        ("full read", full),
        ("snapshot", snapshot),
        ("full read (next turn)", full_after),
    ):
        result.pop("tokens")
        results.append({"arm": arm, **result, "device": args.device, "commit": commit})
        print(
            f"{arm:22s} ttft {result['ttft_s']:8.3f} s  read {result['read_tokens']:6d} of "
            f"{result['prompt_tokens']:6d} tokens  ({result['checkpoint']})",
            flush=True,
        )
    await channel.close()
    for server in (planner, executor, cache):
        await server.stop(None)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=8000)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", default="docs/bench/resume.json")
    parser.add_argument("--commit", default=None, help="the commit measured (default: git rev-parse HEAD)")
    args = parser.parse_args()
    results = asyncio.run(main_async(args))
    write_json(args.out, results)


if __name__ == "__main__":
    main()
