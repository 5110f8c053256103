"""bench/decode.py's measurement of one arm at one concurrency: the clients' requests, timed, and the
planner's and the executor's figures per step over them."""

from __future__ import annotations

import statistics
from dataclasses import asdict

import numpy as np

from bench.decode_arms import Arm
from bench.decode_children import ClientsChild
from bench.step_timeline import summary


def per_step(total: float, steps: int) -> float:
    return round(total / steps, 2) if steps else 0.0


async def measure(
    arm: Arm, clients: ClientsChild, prompts: list[np.ndarray], max_tokens: int
) -> tuple[dict, list[list[int]]]:
    engine_before, runner_before = asdict(arm.engine.times), await arm.runner_times()
    await arm.timeline_steps()  # what came before the round (the warm-up's steps) is no part of it
    arm.link.steady_bytes.clear()
    arm.link.slot_change_bytes.clear()
    # The wall time of the requests' gather in the clients' process, not this round trip: the lines' transfer
    # (a few MB at c=256) is no part of the service.
    results, wall = await clients.generate(arm.address, prompts, max_tokens, arm.client_trust)
    engine = {k: v - engine_before[k] for k, v in asdict(arm.engine.times).items()}
    runner = {k: v - runner_before[k] for k, v in (await arm.runner_times()).items()}
    ttft = [r.arrivals[0][0] - r.sent for r in results if r.arrivals]
    itl: list[float] = []
    for r in results:  # a message of n tokens after a gap stands for n gaps of gap / n
        for (before, _), (after, n) in zip(r.arrivals, r.arrivals[1:]):
            itl += [(after - before) / n] * n
    tokens = sum(len(r.tokens) for r in results)
    failed = sum(1 for r in results if r.error or len(r.tokens) != max_tokens)
    steps, decode_steps = engine["steps"], runner["steps"]
    step_us = wall * 1e6 / steps if steps else 0.0
    graph_us = per_step(runner["graph_us"], decode_steps)
    steady, slot_change = arm.link.steady_bytes, arm.link.slot_change_bytes
    figures = {
        "tok_s": round(tokens / wall, 1),
        "clients_gc_ms": clients.gc_ms,  # inside the wall: the load generator's own pauses
        "itl_p50_ms": round(statistics.median(itl) * 1e3, 3) if itl else None,
        "itl_mean_ms": round(statistics.fmean(itl) * 1e3, 3) if itl else None,
        "ttft_p50_ms": round(statistics.median(ttft) * 1e3, 2) if ttft else None,
        "failed": failed,
        "errors": sorted({r.error for r in results if r.error})[:3],
        "tokens": tokens,
        "wall_s": round(wall, 3),
        "steps": steps,
        "step_us": round(step_us, 1),
        # Host microseconds per step: the planner's phases (per step it ran) and the executor's (per decode step).
        "planner_us": {
            k: per_step(engine[f"{k}_us"], steps)
            for k in ("plan", "encode", "send", "wait", "stream", "commit")
        },
        # Client streams the planner wrote to per step (the rest of the running requests' tokens waited).
        "streams_written_per_step": per_step(engine["streams_written"], steps),
        "executor_us": {
            k: per_step(runner[f"{k}_us"], decode_steps)
            for k in ("apply", "plan", "prefill", "launch", "sync")
        },
        "graph_us": graph_us,
        # The GPU's share of a steady decode step (no prefill in it), from CUDA events: graph time over the
        # time between consecutive replays' ends.
        "gpu_busy_steady": (
            round(runner["steady_graph_us"] / runner["steady_period_us"], 3)
            if runner["steady_period_us"]
            else None
        ),
        "steady_period_us": per_step(runner["steady_period_us"], runner["steady_steps"]),
        # Wall time of a step the decode graph did not cover: prefill on the GPU, and the GPU idle.
        "outside_graph_us": round(step_us - graph_us, 1) if decode_steps else None,
        "plan_bytes_mean": round(engine["plan_bytes"] / steps, 1) if steps else None,
        "steady_plan_bytes_median": int(statistics.median(steady)) if steady else None,
        "steady_plan_bytes_max": max(steady) if steady else None,
        "slot_change_plan_bytes_median": int(statistics.median(slot_change)) if slot_change else None,
    }
    steps = await arm.timeline_steps()
    if steps:  # the summary stays in the round's figures; the steps go to the --timeline file
        arrived = [r.arrivals[-1][0] for r in results if r.arrivals]
        requests = (min(r.sent for r in results), max(arrived)) if arrived else None
        figures["timeline"] = summary(steps, requests)
        figures["timeline_steps"] = steps
    return figures, [r.tokens for r in results]
