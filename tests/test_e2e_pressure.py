"""Under KV pressure (a pool too small for every request at once) all requests still finish correctly."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import pytest_asyncio

from executor_svc.config import ExecutorConfig
from planner_svc.client import GenerateOptions, PlannerClient
from planner_svc.config import PlannerConfig, SchedulingConfig
from tests.conftest import PARITY_TOKENS, SMOL_BUCKETS, start_stack, stop_stack

pytestmark = pytest.mark.asyncio(loop_scope="session")

POOL_PAGES = 161  # 160 usable pages of 16 tokens: one long prompt, or the short ones, at a time


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def small_pool_stack():
    stack, servers = await start_stack(
        ExecutorConfig(
            device="cpu", dtype="float32", pool_pages=POOL_PAGES, buckets=SMOL_BUCKETS, row_check=True
        ),
        PlannerConfig(scheduling=SchedulingConfig(row_check=True, prefill_token_budget=512)),
    )
    yield stack
    await stop_stack(servers)


async def test_kv_pressure_every_request_completes_with_the_right_tokens(small_pool_stack, hf_answers):
    scheduler = small_pool_stack.scheduler
    most_waiting = 0

    async def watch():
        nonlocal most_waiting
        while True:
            most_waiting = max(most_waiting, len(scheduler.waiting))
            await asyncio.sleep(0.005)

    watcher = asyncio.create_task(watch())
    async with PlannerClient(small_pool_stack.addr) as client:
        results = await asyncio.gather(
            *(
                client.generate_all(GenerateOptions(chat=chat, max_tokens=PARITY_TOKENS))
                for chat, _ in hf_answers
            )
        )
    watcher.cancel()
    for got, (_, expected) in zip(results, hf_answers):
        assert got.token_ids == expected
    assert most_waiting > 0, "the pool was never short: the test does not test pressure"
    assert small_pool_stack.engine.row_mismatches == 0
    await small_pool_stack.wait_idle()
    assert scheduler.pages.free_count == scheduler.pages.total


async def test_request_larger_than_the_pool_is_refused_at_once(small_pool_stack):
    async with PlannerClient(small_pool_stack.addr) as client:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await client.generate_all(GenerateOptions(token_ids=[5] * 3000, max_tokens=100))
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert caught.value.details() == "the request needs 194 KV pages and the pool has 160"
    assert small_pool_stack.scheduler.idle
