"""A randomized soak over real gRPC with the row check on: admits, finishes, aborts, page crossings and
displaced rows, on a tiny random model. Every row a step reads equals the planner's mirror (0 mismatches),
and answers under that churn (greedy and seeded) equal the same requests run alone."""
from __future__ import annotations

import asyncio
import random

import pytest

from executor_svc.server import start_executor_server
from planner_svc.client import PlannerClient
from planner_svc.config import PlannerConfig
from planner_svc.link import GrpcLink
from planner_svc.server import start_planner_server
from tests.test_runner import BUCKETS, PAGE, TINY, tiny_model

pytestmark = pytest.mark.asyncio(loop_scope="session")


async def start_tiny_stack(pool_pages: int):
    from executor_svc.runner import StepRunner
    from executor_svc.tables import SlotStore
    from protos.layout import RowLayout

    model = tiny_model()
    layout = RowLayout.build(list(BUCKETS), TINY.max_seq_len, PAGE, pool_pages)
    runner = StepRunner(model, model.make_kv_pool(pool_pages, PAGE), SlotStore(layout, model.device), layout,
                        True, buckets=BUCKETS, fingerprint="tiny")
    executor, port = await start_executor_server(runner)
    planner, planner_port = await start_planner_server(
        PlannerConfig(row_check=True, prefill_token_budget=24), port=0, links=[GrpcLink(f"127.0.0.1:{port}")]
    )
    return f"127.0.0.1:{planner_port}", planner.planner, (planner, executor)


async def one_request(
    client, rng: random.Random, i: int, vocab_size: int = TINY.vocab_size, longest: int = 30, tokens_up_to: int = 25
):
    """A random request (prompt of up to `longest` ids, up to `tokens_up_to` tokens, greedy or seeded) sent after a
    random pause; 15% are abandoned by the client after a few tokens. Returns (fields, tokens, finished)."""
    prompt = [rng.randrange(3, vocab_size) for _ in range(rng.randrange(1, longest))]
    greedy = rng.random() < 0.5
    fields = dict(token_ids=prompt, max_tokens=rng.randrange(1, tokens_up_to), request_id=f"soak-{i}",
                  temperature=0.0 if greedy else rng.choice([0.7, 1.0, 1.5]), seed=rng.randrange(1 << 40),
                  top_k=rng.choice([0, 5]), top_p=rng.choice([1.0, 0.9]),
                  stop_token_ids=[rng.randrange(3, vocab_size)], ignore_eos=True)
    await asyncio.sleep(rng.random() * 0.5)  # staggered arrivals
    abort_after = rng.randrange(1, 6) if rng.random() < 0.15 else None
    tokens = []
    async for response in client.generate(**fields):
        tokens.extend(int.from_bytes(response.token_ids[j:j + 4], "little") for j in range(0, len(response.token_ids), 4))
        if abort_after is not None and len(tokens) >= abort_after:
            break  # the client goes away
    return fields, tokens, abort_after is None


class DisplacedCounter:
    """Counts the rows a slot cache displaces, from the assignments its `assign` returns."""

    def __init__(self, slots) -> None:
        self.count = 0
        assign = slots.assign

        def counting(seq, ids):
            assignment = assign(seq, ids)
            self.count += len(assignment.displaced)
            return assignment

        slots.assign = counting


@pytest.mark.parametrize("pool_pages", [24, 400], ids=["kv-pressure", "slot-pressure"])
async def test_row_check_soak(pool_pages):
    addr, planner, servers = await start_tiny_stack(pool_pages)
    engine = planner.engines[0]
    rng = random.Random(pool_pages)
    slots = engine.scheduler.slots
    displaced = DisplacedCounter(slots)
    try:
        async with PlannerClient(addr) as client:
            results = await asyncio.gather(*(one_request(client, rng, i) for i in range(60)))
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
                    alone = await client.generate_all(**{**fields, "request_id": fields["request_id"] + "-alone"})
                    assert tokens == alone.token_ids
    finally:
        for server in servers:
            await server.stop(None)
