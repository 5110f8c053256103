"""bench/decode.py's run: the clients' and executors' children started, the arms built, the warm-up, the
rounds measured, and their records."""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time

import numpy as np
import structlog
import torch

from bench.common import commit_hash, write_json
from bench.decode_arms import TLS_ARM, Arm, executor_process, in_process, make_certs, start_arm
from bench.decode_children import ClientsChild, ExecutorChild
from bench.decode_measure import measure
from bench.decode_model import PAGE_SIZE, SMOLLM2, build_runner, executor_config, int_list, random_model
from bench.decode_report import agreement
from bench.step_timeline import ExecutorTimeline, PlannerTimeline, in_ms
from executor_svc.config import DEFAULT_BUCKETS
from executor_svc.runner import StepRunner
from planner_svc.config import PlannerConfig, SchedulingConfig
from protos.heap import freeze_startup_heap


async def run(args: argparse.Namespace) -> list[dict]:
    device = torch.device(args.device)
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    widest = max(concurrencies)
    pages_per_request = -(-(args.prompt_tokens + args.output_tokens + 1) // PAGE_SIZE)
    pool_pages = widest * pages_per_request + 64
    buckets = tuple(b for b in DEFAULT_BUCKETS if b < widest) + (widest,)
    scheduling = SchedulingConfig(prefix_cache=False, prefill_token_budget=args.prefill_token_budget)
    planner_config = PlannerConfig(model=args.tokenizer, scheduling=scheduling)
    runners: dict[str, StepRunner] = {}
    children: dict[str, ExecutorChild] = {}
    capture: dict[str, dict] = {}
    arms: dict[str, Arm] = {}
    clients: ClientsChild | None = None
    timeline: list[dict] = []  # --timeline: each round's steps
    certs = make_certs(tempfile.mkdtemp(prefix="bench-tls-")) if TLS_ARM in args.arms else None
    try:
        # The clients' process first, before this one has a gRPC thread: a fork (the subprocess's spawn) while
        # gRPC's threads run skips its fork handlers, and the child died of SIGSEGV before it was ready.
        clients = await ClientsChild.start("clients", "--serve-clients")
        # The executors' children, one at a time, then this process's runner: each capture has the GPU to
        # itself (and a capture must be the only CUDA work in its process).
        for name in sorted(args.arms, key=in_process):
            began = time.perf_counter()
            if in_process(name):
                config = executor_config(
                    args.device, pool_pages, buckets, name, int_list(args.prefill_buckets)
                )
                runner, states = build_runner(
                    random_model(device, args.model_shape), config, args.model_shape
                )
            else:
                child = children[name] = await ExecutorChild.start(
                    f"{name} executor",
                    "--serve-executor",
                    name,
                    "--device",
                    args.device,
                    "--pool-pages",
                    str(pool_pages),
                    "--buckets",
                    ",".join(map(str, buckets)),
                    "--model-shape",
                    args.model_shape,
                    "--prefill-buckets",
                    args.prefill_buckets,
                    *(["--serve-timeline"] if args.timeline else []),
                    *(
                        ["--tls-cert", certs["cert"], "--tls-key", certs["key"]]
                        if name == TLS_ARM and certs
                        else []
                    ),
                )
                runner, states = None, await child.ready()
            if "error" in states:
                print(f"{name}: not built: {states['error']}", flush=True)
            else:
                print(f"{name}: built in {time.perf_counter() - began:.1f} s; buckets {states}", flush=True)
                if all(state.startswith("eager (capture failed") for state in states.values()):
                    states = {"error": f"no bucket could be captured: {states[str(buckets[0])]}"}
            capture[name] = states
            if "error" in states:
                if name in children:
                    await children.pop(name).close()
            elif runner is not None:
                runners[name] = runner
        # Planners start once every capture is done.
        for name in args.arms:
            if name in runners or name in children:
                arm = arms[name] = await start_arm(
                    name, planner_config, runners.get(name), children.get(name), certs
                )
                if args.timeline:
                    arm.link.timeline = PlannerTimeline()
                    if arm.runner is not None:
                        arm.executor_timeline = ExecutorTimeline(arm.runner)
        structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
        freeze_startup_heap()  # as `deltaserve planner` does once serving
        await clients.ready()

        rng = np.random.default_rng(0)
        # Prompts of the measured length at every measured concurrency: the kernels compile, and every bucket's
        # graph makes its first replay, for the shapes the rounds will run.
        for c in concurrencies:
            warm = [
                rng.integers(3, SMOLLM2.vocab_size, size=args.prompt_tokens).astype(np.int32)
                for _ in range(c)
            ]
            for arm in arms.values():
                await measure(arm, clients, warm, 8)
        results: dict[tuple[str, int], list[dict]] = {}
        outputs: dict[tuple[str, int, int], list[list[int]]] = {}
        for round_index in range(args.rounds):
            for c in concurrencies:
                # The same prompts for every arm and round, so their outputs can be compared.
                prompts = [
                    np.random.default_rng(1000 + c * 7 + i)
                    .integers(3, SMOLLM2.vocab_size, size=args.prompt_tokens)
                    .astype(np.int32)
                    for i in range(c)
                ]
                for name, arm in arms.items():
                    figures, tokens = await measure(arm, clients, prompts, args.output_tokens)
                    steps = figures.pop("timeline_steps", None)
                    if steps:
                        timeline.append(
                            {"arm": name, "concurrency": c, "round": round_index + 1, "steps": in_ms(steps)}
                        )
                    results.setdefault((name, c), []).append(figures)
                    outputs[(name, c, round_index)] = tokens
                    print(
                        f"round {round_index + 1} {name:19s} c={c:4d}  {figures['tok_s']:9.1f} tok/s  "
                        f"ITL p50 {figures['itl_p50_ms']} ms mean {figures['itl_mean_ms']} ms  "
                        f"TTFT p50 {figures['ttft_p50_ms']} ms  failed {figures['failed']}  "
                        f"step {figures['step_us']} us (graph {figures['graph_us']}, steady period "
                        f"{figures['steady_period_us']}, busy {figures['gpu_busy_steady']})  "
                        f"streams/step {figures['streams_written_per_step']}  "
                        f"planner {figures['planner_us']}  executor {figures['executor_us']}  "
                        f"steady plan {figures['steady_plan_bytes_median']} B",
                        flush=True,
                    )
                    if "timeline" in figures:
                        print(f"  timeline {figures['timeline']}", flush=True)
    finally:
        if clients is not None:
            await clients.close()
        for arm in arms.values():
            await arm.server.stop(None)
        for child in children.values():
            await child.close()

    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "none (CPU smoke run)"
    records = []
    for (name, c), rounds in results.items():
        record = {
            "arm": name,
            "executor_process": executor_process(name),
            "clients_process": "child",
            "concurrency": c,
            "tok_s": round(statistics.fmean(r["tok_s"] for r in rounds), 1),
            "itl_p50_ms": round(statistics.fmean(r["itl_p50_ms"] or 0.0 for r in rounds), 3),
            "itl_mean_ms": round(statistics.fmean(r["itl_mean_ms"] or 0.0 for r in rounds), 3),
            "ttft_p50_ms": round(statistics.fmean(r["ttft_p50_ms"] or 0.0 for r in rounds), 2),
            "failed": sum(r["failed"] for r in rounds),
            "model_shape": args.model_shape,
            "prompt_tokens": args.prompt_tokens,
            "output_tokens": args.output_tokens,
            "prefill_token_budget": scheduling.for_device(args.device).token_budget,
            "prefill_buckets": args.prefill_buckets,
            "rounds": rounds,
            "capture": capture[name],
            "commit": args.commit or commit_hash(),
            "gpu": gpu,
        }
        # bf16: against the resident arm's first round, and against its own other round (its own spread).
        if ("resident", c, 0) in outputs and name != "resident":
            record["agreement_with_resident"] = agreement(outputs[("resident", c, 0)], outputs[(name, c, 0)])
        if args.rounds > 1:
            record["agreement_across_rounds"] = agreement(outputs[(name, c, 0)], outputs[(name, c, 1)])
        records.append(record)
    for name, state in capture.items():
        if "error" in state:
            records.append(
                {
                    "arm": name,
                    "executor_process": executor_process(name),
                    "clients_process": "child",
                    "error": state["error"],
                    "commit": args.commit or commit_hash(),
                    "gpu": gpu,
                }
            )
    if args.timeline:
        write_json(args.timeline, timeline)
    return records
