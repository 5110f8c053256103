"""Host cost of planning and encoding one decode step: steady, with 10% of rows crossing a page, and with
10% of rows stale.

    python bench/planner.py [--steps 2000] [--out docs/bench/planner.json]

Prints one line per case and writes them as JSON (case, rows, plan_us_median, message_bytes, commit).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import commit_hash, write_json
from planner_svc.config import SchedulingConfig
from planner_svc.planned import PlannedStep
from planner_svc.requests import Request
from planner_svc.scheduler import Scheduler, SchedulerConfig
from planner_svc.step_wire import to_proto
from protos.layout import RowLayout

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def measure(rows: int, case: str, steps: int) -> dict:
    # Page size 10 with lengths staggered: exactly 10% of rows cross a page every step ("crossing"); a request
    # holds its pages from admission, so a crossing sends nothing.
    page_size = 10 if case == "crossing" else 16
    max_seq_len = 8192
    pool_pages = rows * (max_seq_len // page_size) + 1
    config = SchedulerConfig(
        page_size,
        pool_pages,
        BUCKETS,
        max_seq_len,
        vocab_size=49152,
        settings=SchedulingConfig(prefill_token_budget=1 << 20),
    )
    scheduler = Scheduler(config, RowLayout.build(list(BUCKETS), max_seq_len, page_size, pool_pages))
    stagger = page_size if case == "crossing" else 1  # steady: every row crosses on the same step
    requests = [Request(f"r{i}", [1] * (100 + i % stagger), 8000) for i in range(rows)]
    for request in requests:
        scheduler.add(request)
    seq = 0
    pending: list[PlannedStep] = []
    samples: list[float] = []
    sizes: list[int] = []
    tokens = np.full(256, 7, dtype=np.int32)
    rng = np.random.default_rng(0)
    while seq < steps + 8:
        if len(pending) >= 2:
            done = pending.pop(0)
            scheduler.commit(done.seq, tokens[: done.bucket], np.full(len(done.prefill), 7, np.int32))
            if case == "stale" and seq > 8:  # 10% of rows lose their device row every step
                picks = rng.choice(rows, size=max(1, rows // 10), replace=False)
                scheduler.mark_stale([requests[i] for i in picks])
        began = time.perf_counter_ns()
        step = scheduler.plan(seq)
        # None only when nothing can run until a commit; here step seq - 2 has committed and every request
        # still decodes (8000 tokens each, more than the steps measured).
        assert step is not None
        message = to_proto(step).SerializeToString()
        elapsed = time.perf_counter_ns() - began
        if seq >= 8:  # past the prefill and the first whole-row writes
            samples.append(elapsed / 1000)
            sizes.append(len(message))
        pending.append(step)
        seq += 1
    return {
        "case": case,
        "rows": rows,
        "plan_us_median": round(statistics.median(samples), 2),
        "plan_us_p90": round(float(np.percentile(samples, 90)), 2),
        "message_bytes": int(statistics.median(sizes)),
        "message_bytes_max": int(max(sizes)),
        "steps": len(samples),
        "commit": commit_hash(),
        "host": platform.node(),
        "python": platform.python_version(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--out", default="docs/bench/planner.json")
    args = parser.parse_args()
    results = []
    for case in ("steady", "crossing", "stale"):
        for rows in (1, 16, 64, 256):
            result = measure(rows, case, args.steps)
            results.append(result)
            print(
                f"{case:9s} rows={rows:4d}  plan+encode median {result['plan_us_median']:8.2f} us"
                f"  p90 {result['plan_us_p90']:8.2f} us  message {result['message_bytes']:6d} B"
                f" (max {result['message_bytes_max']})",
                flush=True,
            )
    write_json(args.out, results)


if __name__ == "__main__":
    main()
