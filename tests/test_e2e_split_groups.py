"""Data-parallel groups of a layer split behind one planner (issue 18): two groups of two stage processes
(gloo) of a tiny random Llama 3, each attached as one engine. Requests spread over both by load, greedy tokens
equal transformers' all at once and one at a time, a conversation's turns stay on the group that holds its
checkpoint, and the row check finds no mismatch on any stage."""

from __future__ import annotations

import pytest

from planner_svc.client import GenerateOptions, PlannerClient
from planner_svc.config import PlannerConfig, SchedulingConfig
from planner_svc.server import start_planner_server
from tests.split_stages import StageGroup
from tests.test_faults_layer_split import RANGES, equals_transformers, tiny_checkpoint

pytestmark = pytest.mark.asyncio(loop_scope="session")


async def test_two_groups_share_the_load_and_keep_conversations(tmp_path):
    model = tiny_checkpoint(tmp_path / "tiny", "llama3")
    flags = ("--model", model, "--device", "cpu", "--dtype", "float32", "--pool-pages", "64")
    flags += ("--buckets", "1,2,4", "--page-size", "4")
    groups = [StageGroup(tmp_path, RANGES, flags=flags) for _ in range(2)]
    planner = None
    try:
        for group in groups:
            group.wait_listening()
        config = PlannerConfig(
            executor_groups=[group.addresses for group in groups],
            scheduling=SchedulingConfig(row_check=True, prefill_token_budget=64),
        )
        planner = await start_planner_server(config, port=0)
        engines = planner.servicer.engines
        assert len(engines) == 2
        async with PlannerClient(f"127.0.0.1:{planner.port}") as client:
            await equals_transformers(client, model)
            assert all(engine.steps > 0 for engine in engines), "least-load routing used one group only"
            history = [5, 9, 11, 7, 3, 12, 30]
            options = GenerateOptions(token_ids=history, max_tokens=4, conversation_id="c")
            first = await client.generate_all(options)
            holder, _ = planner.servicer.turns.find("", "c")
            second = await client.generate_all(
                GenerateOptions(
                    token_ids=[*history, *first.token_ids, 8, 2], max_tokens=4, conversation_id="c"
                )
            )
            assert planner.servicer.turns.find("", "c")[0] is holder
            # the other group holds no checkpoint of it: a reuse says the turn went to the holder
            assert second.checkpoint.startswith("checkpoint@") and second.reused_tokens > 0
        assert [engine.row_mismatches for engine in engines] == [0, 0]
    finally:
        if planner is not None:
            await planner.stop(None)
        for group in groups:
            group.stop()
