"""Row check on the GPU (issue 3): resident decode graphs over real gRPC, the executor comparing every row a
replayed step read with the planner's mirror, for at least --steps decode steps per case.

    python bench/gpu_row_check.py --tokenizer DIR [--steps 5000] [--out docs/bench/gpu_row_check.json]

SmolLM2-135M's shape (or --model-shape qwen3.5-0.8b, the hybrid) with random bf16 weights. Two cases (three for
the hybrid: `state-pressure`, fewer recurrent-state slots than live requests), each a randomized soak of staggered requests
(random prompts and lengths, greedy and seeded sampling, 15% abandoned mid-stream by their client, prefill
chunked by a small token budget): `kv-pressure` (a pool too small for every request at once, so admission
waits for pages) and `slot-pressure` (buckets capped at 4 rows for 24 live requests, so rows are displaced
and written whole again every few steps). Writes one JSON object per case with the mismatch count.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The soak's request generator comes from a test module that defaults Triton to its CPU interpreter: here the
# kernels run compiled on the GPU unless the caller says otherwise.
os.environ.setdefault("TRITON_INTERPRET", "0")

import deltaserve.aio
from bench.common import commit_hash, write_json
from bench.decode_model import MODEL_SHAPES, random_model
from bench.soak import DisplacedCounter, one_request
from executor_svc.config import ExecutorConfig
from executor_svc.runner import runner_for_model
from executor_svc.server import start_executor_server
from planner_svc.client import PlannerClient
from planner_svc.config import PlannerConfig, SchedulingConfig
from planner_svc.link import GrpcLink
from planner_svc.server import start_planner_server

PAGE_SIZE = 16
MAX_SEQ_LEN = 512
# name: (pool pages, buckets, live requests at a time, recurrent-state slots or None for the default)
CASES = {
    "kv-pressure": (48, (1, 2, 4, 8, 16), 24, None),
    "slot-pressure": (1024, (1, 2, 4), 24, None),
}
# a hybrid model's too: fewer state slots (the sink included) than live requests, so admission waits for them
STATE_CASES = {"state-pressure": (1024, (1, 2, 4, 8, 16), 24, 9)}


async def soak(name: str, case: tuple, model, tokenizer: str | None, steps: int) -> dict:
    pool_pages, buckets, live, state_slots = case
    config = ExecutorConfig(
        device="cuda",
        dtype="bfloat16",
        page_size=PAGE_SIZE,
        pool_pages=pool_pages,
        max_seq_len=MAX_SEQ_LEN,
        buckets=buckets,
        row_check=True,
        state_slots=state_slots,
    )
    runner = runner_for_model(model, config, "random-smollm2")
    captured = sum(state.startswith("captured, host-plan-free") for state in runner.graphs.states.values())
    executor = await start_executor_server(runner)
    planner = await start_planner_server(
        PlannerConfig(
            model=tokenizer,
            scheduling=SchedulingConfig(row_check=True, prefill_token_budget=96, prefix_cache=False),
        ),
        port=0,
        links=[GrpcLink(f"127.0.0.1:{executor.port}")],
    )
    engine = planner.servicer.engines[0]
    displaced = DisplacedCounter(engine.scheduler.slots)
    rng = random.Random(name)
    requests = finished = 0
    began = time.perf_counter()
    try:
        async with PlannerClient(f"127.0.0.1:{planner.port}") as client:
            while runner.times.steps < steps:
                wave = [
                    one_request(
                        client, rng, requests + i, model.config.vocab_size, longest=300, tokens_up_to=120
                    )
                    for i in range(live)
                ]
                requests += live
                finished += sum(done for _, _, done in await asyncio.gather(*wave))
                print(
                    f"{name}: {runner.times.steps} resident steps, {engine.row_mismatches} mismatches",
                    flush=True,
                )
            while not engine.scheduler.idle:
                await asyncio.sleep(0.01)
    finally:
        await planner.stop(None)
        await executor.stop(None)
    scheduler = engine.scheduler
    return {
        "case": name,
        "resident_steps": runner.times.steps,
        "row_mismatches": engine.row_mismatches,
        "requests": requests,
        "finished": finished,
        "abandoned": requests - finished,
        "displaced_rows": displaced.count,
        "buckets_captured_host_plan_free": f"{captured}/{len(buckets)}",
        "pages_all_free_after": scheduler.pages.free_count == scheduler.pages.total,
        "slots_all_free_after": scheduler.slots.free_count == scheduler.slots.num_slots - 1,
        "state_slots_all_free_after": scheduler.states.free_count == max(scheduler.states.num_slots - 1, 0),
        "pool_pages": pool_pages,
        "buckets": list(buckets),
        "seconds": round(time.perf_counter() - began, 1),
    }


async def run(args: argparse.Namespace) -> list[dict]:
    model = random_model(torch.device("cuda"), args.model_shape)
    gpu = torch.cuda.get_device_name()
    records = []
    cases = {**CASES, **(STATE_CASES if args.model_shape != MODEL_SHAPES[0] else {})}
    for name, case in cases.items():
        record = await soak(name, case, model, args.tokenizer, args.steps)
        record.update(commit=args.commit or commit_hash(), gpu=gpu, model_shape=args.model_shape)
        print(record, flush=True)
        records.append(record)
    return records


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokenizer", default=None, help="tokenizer dir or GGUF (default: the SmolLM2 GGUF)")
    parser.add_argument("--steps", type=int, default=5000, help="resident decode steps per case, at least")
    parser.add_argument(
        "--model-shape",
        choices=MODEL_SHAPES,
        default=MODEL_SHAPES[0],
        help="qwen3.5-0.8b: the hybrid, with a third case under recurrent-state slot pressure",
    )
    parser.add_argument("--out", default="docs/bench/gpu_row_check.json")
    parser.add_argument("--commit", default=None, help="the commit measured (default: git rev-parse HEAD)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/gpu_row_check.py needs a CUDA device")
    records = deltaserve.aio.run(lambda stop: run(args))
    write_json(args.out, records)
    failed = sum(r["row_mismatches"] for r in records)
    sys.exit(f"{failed} row mismatches" if failed else 0)


if __name__ == "__main__":
    main()
