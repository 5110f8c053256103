"""The planner's host work per step at high concurrency (issue 20), and the executor's `apply` of the same plans,
on the CPU, with no model: where the H200 idles at c = 256.

    python bench/planner_host.py [--concurrency 256] [--device-ms 4.8] [--profile planner.prof]
                                 [--out docs/bench/planner_host.json]

The real planner server (scheduler, engine, response streams, detokenizer) and real gRPC clients in a child
process (bench/decode.py's load generator: random 512-token prompts, 256 output tokens, every request at once).
The executor is a stand-in, `DeviceStandIn`: it answers each plan `--device-ms` after the step before it ended
(the GPU's graph time; two plans in flight as with a real executor), with token ids drawn at random, so what is
timed is the planner's own work: the engine's `plan`, `commit`, `stream` (the client writes released before
each wait) and the rest of each step, as bench/decode.py records them. The plans it received are then applied,
in order, to a real CPU slot store (`check_plan` and `SlotStore.apply`, the executor's `apply` phase; on a GPU it
also launches copies). `--profile FILE` writes cProfile's stats of the planner's event loop over the measured
round (read with `python -m pstats FILE`).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import gc
import logging
import os
import statistics
import sys
import time
from collections import deque
from dataclasses import asdict

import numpy as np
import structlog
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import commit_hash, write_json
from bench.decode_children import ClientsChild
from bench.decode_measure import per_step
from bench.decode_model import PAGE_SIZE, SMOLLM2
from executor_svc.config import DEFAULT_BUCKETS
from executor_svc.plan import PlanLimits, check_plan
from executor_svc.slot_store import SlotStore
from planner_svc.config import PlannerConfig, SchedulingConfig
from planner_svc.server import start_planner_server
from protos import executor_pb2
from protos.heap import freeze_startup_heap
from protos.layout import RowLayout
from protos.wire import pack_i32

MAX_SEQ_LEN = 1024


class DeviceStandIn:
    """An executor link with no executor behind it: each step ends `device_s` after it could start (its plan
    sent, the step before it ended), and its output is the tokens of its rows and sampling prefill chunks, drawn
    at random below `vocab`. Keeps every plan for the apply replay."""

    def __init__(self, layout: RowLayout, pool_pages: int, device_s: float, vocab: int) -> None:
        self.address = "device-stand-in"
        self.layout = layout
        self.pool_pages = pool_pages
        self.device_s = device_s
        self.plans: list[executor_pb2.StepPlan] = []
        self._due: deque[tuple[executor_pb2.StepPlan, float]] = deque()
        self._free_at = 0.0  # when the stand-in's device finishes the last step sent
        self._rng = np.random.default_rng(0)
        self._vocab = vocab

    async def describe(self) -> executor_pb2.ExecutorDescription:
        buckets = [b for b in DEFAULT_BUCKETS if b < self.layout.widest_bucket] + [self.layout.widest_bucket]
        return executor_pb2.ExecutorDescription(
            model_name="device stand-in",
            model_fingerprint="device-stand-in",
            vocab_size=self._vocab,
            max_seq_len=MAX_SEQ_LEN,
            num_layers=1,
            page_size=PAGE_SIZE,
            pool_pages=self.pool_pages,
            buckets=buckets,
            slots=self.layout.slots,
            row_columns=self.layout.columns,
            block_span=self.layout.block_span,
            device="stand-in",
            dtype="bfloat16",
            layer_begin=0,
            layer_end=1,
            eos_token_id=0,
            eos_token_ids=[0],
        )

    async def open(self) -> None:
        self._due.clear()

    async def send(self, plan: executor_pb2.StepPlan) -> None:
        self.plans.append(plan)
        now = time.perf_counter()
        self._free_at = max(self._free_at, now) + self.device_s
        self._due.append((plan, self._free_at))

    async def recv(self) -> executor_pb2.StepOutput:
        plan, due = self._due.popleft()
        wait = due - time.perf_counter()
        if wait > 0:
            await asyncio.sleep(wait)
        samples = [chunk.sample_slot != 0 for chunk in plan.prefill]
        tokens = self._rng.integers(3, self._vocab, size=plan.bucket + len(samples)).astype(np.int32)
        prefill = np.where(samples, tokens[plan.bucket :], -1).astype(np.int32)
        return executor_pb2.StepOutput(
            seq=plan.seq, tokens=pack_i32(tokens[: plan.bucket]), prefill_tokens=pack_i32(prefill)
        )

    async def until_ended(self) -> str:
        await asyncio.Event().wait()
        return "never"

    async def park(self, request: executor_pb2.ParkPagesRequest) -> executor_pb2.ParkPagesReply:
        raise NotImplementedError("the stand-in keeps no pages: the benchmark parks no conversation")

    async def restore(self, request: executor_pb2.RestorePagesRequest) -> executor_pb2.RestorePagesReply:
        raise NotImplementedError("the stand-in keeps no pages: the benchmark restores no conversation")

    async def prepare_grammar(self, grammar: executor_pb2.Grammar) -> None:
        raise NotImplementedError("the benchmark's requests ask for no grammar")

    async def close(self) -> None:
        pass


class GcTimes:
    """The time each generation's collections took, from gc.callbacks."""

    def __init__(self) -> None:
        self.ms = [0.0, 0.0, 0.0]
        self.count = [0, 0, 0]
        self._began = 0.0

    def note(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._began = time.perf_counter()
            return
        generation = info["generation"]
        self.ms[generation] += (time.perf_counter() - self._began) * 1e3
        self.count[generation] += 1

    def summary(self) -> dict:
        return {f"gen{g}": {"count": self.count[g], "ms": round(self.ms[g], 1)} for g in range(3)}


def apply_replay(
    plans: list[executor_pb2.StepPlan], measured: int, layout: RowLayout, pool_pages: int
) -> dict:
    """The executor's `apply` phase (check the plan, write it into a CPU slot store) of each plan, in order;
    timed from plan `measured` on (the earlier ones: the warm-up's)."""
    store = SlotStore(layout, torch.device("cpu"), SMOLLM2.vocab_size)
    buckets = tuple(b for b in DEFAULT_BUCKETS if b < layout.widest_bucket) + (layout.widest_bucket,)
    limits = PlanLimits(
        layout, buckets, SMOLLM2.vocab_size, MAX_SEQ_LEN, PAGE_SIZE, pool_pages, store.max_run_cells
    )
    steady: list[float] = []
    writing: list[float] = []
    for index, plan in enumerate(plans):
        began = time.perf_counter()
        checked = check_plan(plan, limits, store.bucket)
        store.apply(checked)
        took = (time.perf_counter() - began) * 1e6
        if index < measured:
            continue
        (writing if len(checked.sampler_slots) or checked.rows.segments else steady).append(took)
    return {
        "plans": len(plans) - measured,
        "writing_plans": len(writing),
        "apply_us_mean": round(statistics.fmean(steady + writing), 1),
        "apply_us_writing_median": round(statistics.median(writing), 1) if writing else None,
        "apply_us_steady_median": round(statistics.median(steady), 1) if steady else None,
    }


async def run(args: argparse.Namespace) -> dict:
    c = args.concurrency
    pool_pages = c * -(-(args.prompt_tokens + args.output_tokens + 1) // PAGE_SIZE) + 64
    buckets = [b for b in DEFAULT_BUCKETS if b < c] + [c]
    layout = RowLayout.build(buckets, MAX_SEQ_LEN, PAGE_SIZE, pool_pages)
    stand_in = DeviceStandIn(layout, pool_pages, args.device_ms / 1e3, SMOLLM2.vocab_size)
    # The executor's own prefill budget on a GPU (SchedulingConfig.for_device).
    scheduling = SchedulingConfig(prefix_cache=False).for_device("cuda")
    planner = await start_planner_server(
        PlannerConfig(model=args.tokenizer, scheduling=scheduling), links=[stand_in]
    )
    engine = planner.servicer.engines[0]
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    if not args.no_freeze:
        freeze_startup_heap()  # as `deltaserve planner` does once serving
    address = f"127.0.0.1:{planner.port}"
    clients = await ClientsChild.start("clients", "--serve-clients")
    rng = np.random.default_rng(0)
    try:
        await clients.ready()
        prompts = [
            rng.integers(3, SMOLLM2.vocab_size, size=args.prompt_tokens).astype(np.int32) for _ in range(c)
        ]
        await clients.generate(address, prompts, 8)  # warm-up
        warm_plans = len(stand_in.plans)
        before = asdict(engine.times)
        collections = GcTimes()
        gc.callbacks.append(collections.note)
        profile = cProfile.Profile() if args.profile else None
        if profile is not None:
            profile.enable()
        results, wall = await clients.generate(address, prompts, args.output_tokens)
        if profile is not None:
            profile.disable()
            profile.dump_stats(args.profile)
        times = {k: v - before[k] for k, v in asdict(engine.times).items()}
        gc.callbacks.remove(collections.note)
    finally:
        await clients.close()
        await planner.stop(None)
    steps = times["steps"]
    tokens = sum(len(r.tokens) for r in results)
    return {
        "concurrency": c,
        "device_ms": args.device_ms,
        "prompt_tokens": args.prompt_tokens,
        "output_tokens": args.output_tokens,
        "failed": sum(1 for r in results if r.error or len(r.tokens) != args.output_tokens),
        "tok_s": round(tokens / wall, 1),
        "steps": steps,
        "step_us": round(wall * 1e6 / steps, 1) if steps else None,
        # the stand-in device's busy share: how far the planner's host work stretched the step
        "device_busy": round(steps * args.device_ms * 1e3 / (wall * 1e6), 3) if steps else None,
        "planner_us": {
            k: per_step(times[f"{k}_us"], steps)
            for k in ("plan", "encode", "send", "wait", "stream", "commit")
        },
        "streams_written_per_step": per_step(times["streams_written"], steps),
        # this process's cyclic garbage collections over the measured round (planner, and the stand-in)
        "gc": collections.summary(),
        "executor_apply": apply_replay(stand_in.plans, warm_plans, layout, pool_pages),
        "heap_frozen": not args.no_freeze,
        "commit": args.commit or commit_hash(),
        "host": "CPU (no device)",
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument(
        "--device-ms", type=float, default=4.8, help="the stand-in device's step (c = 256 graph)"
    )
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--output-tokens", type=int, default=256)
    parser.add_argument("--tokenizer", default=None, help="tokenizer dir or GGUF (default: the SmolLM2 GGUF)")
    parser.add_argument("--profile", default=None, help="write cProfile stats of the measured round here")
    parser.add_argument("--no-freeze", action="store_true", help="leave the start-up heap to the collector")
    parser.add_argument("--out", default=None, help="append the record to this JSON file")
    parser.add_argument("--commit", default=None)
    args = parser.parse_args()
    record = asyncio.run(run(args))
    print(record, flush=True)
    if args.out:
        import json

        records = json.load(open(args.out)) if os.path.exists(args.out) else []
        write_json(args.out, records + [record])


if __name__ == "__main__":
    main()
