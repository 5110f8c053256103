"""A short prompt's CPU prefill (issue 17), through the C decode step 8 tokens a call against the torch layers
(matmuls over de-quantized tiles), alternated in one process: SmolLM2's GGUF with packed weights, the runner's
own prefill plan (one chunk, sampled), wall ms a prefill, median of the rounds.

    python bench/cpu_prefill.py [--lengths 8,28,64,96,128] [--rounds 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import commit_hash, write_json
from executor_svc.config import ExecutorConfig
from executor_svc.models import dense
from executor_svc.runner import build_runner
from protos import executor_pb2
from protos.wire import pack_i32

ARMS = {"C step": 1 << 30, "torch layers": 0}  # dense.CPU_PREFILL_TOKENS for each


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--lengths", type=lambda s: [int(x) for x in s.split(",")], default=[8, 28, 64, 96, 128]
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--out", default="docs/bench/cpu_prefill.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    runner = build_runner(ExecutorConfig(device="cpu", pool_pages=256, buckets=(1, 2, 4, 8)))
    time.sleep(15)  # the runner's grammar warm-up thread takes a core for its first seconds
    results = []
    for length in args.lengths:
        ids = pack_i32([(17 * i) % 40000 + 100 for i in range(length)])
        times: dict[str, list[float]] = {arm: [] for arm in ARMS}
        for done in range(args.rounds + 1):  # the first round warms up, not counted
            for arm, limit in ARMS.items():
                dense.CPU_PREFILL_TOKENS = limit
                for first_page in (1, 100):  # two places in the pool, so no run reads the last one's pages
                    pages = pack_i32(list(range(first_page, first_page + -(-length // 16))))
                    chunk = executor_pb2.PrefillChunk(token_ids=ids, start=0, pages=pages, sample_slot=0)
                    began = time.perf_counter()
                    runner.run(executor_pb2.StepPlan(seq=1, prefill=[chunk]))
                    if done:
                        times[arm].append((time.perf_counter() - began) * 1e3)
        row = {arm: round(statistics.median(values), 1) for arm, values in times.items()}
        print(f"{length:4d} tokens: " + ", ".join(f"{arm} {ms} ms" for arm, ms in row.items()), flush=True)
        results.append({"tokens": length, "ms": row, "threads": args.threads, "commit": commit_hash()})
    write_json(args.out, results)


if __name__ == "__main__":
    main()
