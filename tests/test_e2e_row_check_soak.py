"""A randomized soak over real gRPC with the row check on: admits, finishes, aborts, page crossings and
displaced rows, on a tiny random model. Every row a step reads equals the planner's mirror (0 mismatches),
and answers under that churn (greedy and seeded) equal the same requests run alone."""

from __future__ import annotations

import asyncio
import random

import pytest

from bench.soak import DisplacedCounter, one_request
from executor_svc.server import start_executor_server
from planner_svc.client import GenerateOptions, PlannerClient
from planner_svc.config import PlannerConfig, SchedulingConfig
from planner_svc.link import GrpcLink
from planner_svc.server import start_planner_server
from tests.runner_script import BUCKETS, PAGE, TINY, tiny_model

pytestmark = pytest.mark.asyncio(loop_scope="session")


async def start_tiny_stack(pool_pages: int):
    from executor_svc.runner import StepRunner
    from executor_svc.slot_store import SlotStore
    from protos.layout import RowLayout

    model = tiny_model()
    layout = RowLayout.build(list(BUCKETS), TINY.max_seq_len, PAGE, pool_pages)
    runner = StepRunner(
        model,
        model.make_kv_pool(pool_pages, PAGE),
        SlotStore(layout, model.device, model.config.vocab_size),
        layout,
        True,
        buckets=BUCKETS,
        fingerprint="tiny",
    )
    executor = await start_executor_server(runner)
    planner = await start_planner_server(
        PlannerConfig(scheduling=SchedulingConfig(row_check=True, prefill_token_budget=24)),
        port=0,
        links=[GrpcLink(f"127.0.0.1:{executor.port}")],
    )
    return f"127.0.0.1:{planner.port}", planner.servicer, (planner, executor)


@pytest.mark.parametrize("pool_pages", [24, 400], ids=["kv-pressure", "slot-pressure"])
async def test_row_check_soak(pool_pages):
    addr, planner, servers = await start_tiny_stack(pool_pages)
    engine = planner.engines[0]
    rng = random.Random(pool_pages)
    slots = engine.scheduler.slots
    displaced = DisplacedCounter(slots)
    try:
        async with PlannerClient(addr) as client:
            results = await asyncio.gather(*(one_request(client, rng, i, TINY.vocab_size) for i in range(60)))
            while not engine.scheduler.idle:
                await asyncio.sleep(0.01)
            assert engine.row_mismatches == 0
            assert engine.steps > 100
            if pool_pages > 100:
                assert displaced.count > 10, "the soak never displaced a row"
            assert engine.scheduler.pages.free_count == engine.scheduler.pages.total
            assert slots.free_count == slots.num_slots - 1
            # Answers under churn (greedy and seeded) equal the same request alone: rows written whole were right.
            for fields, tokens, finished in results:
                if finished:
                    alone = await client.generate_all(
                        GenerateOptions(**{**fields, "request_id": fields["request_id"] + "-alone"})
                    )
                    assert tokens == alone.token_ids
    finally:
        for server in servers:
            await server.stop(None)
