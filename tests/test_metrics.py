"""The planner's Prometheus metrics over the real stack: the endpoint parsed with prometheus-client's own
parser before and after requests (a plain one, and a conversation's second turn reusing its checkpoint)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import httpx2 as httpx
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from planner_svc.client import GenerateOptions, PlannerClient
from planner_svc.metrics import PlannerMetrics
from protos.metrics_port import serve_metrics

pytestmark = pytest.mark.asyncio(loop_scope="session")


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


async def test_counters_histograms_and_gauges_move_with_requests(smol_stack):
    registry = CollectorRegistry()
    metrics = PlannerMetrics(registry)
    metrics.follow(lambda: [engine.scheduler for engine in smol_stack.planner.engines])
    served = serve_metrics(registry, "127.0.0.1", 0)
    smol_stack.planner.metrics = metrics
    try:
        await smol_stack.wait_idle()
        before = await asyncio.to_thread(scrape, served.port)
        assert before[("deltaserve_kv_pages_total", ())] == smol_stack.scheduler.pages.total
        assert before[("deltaserve_requests_running", ())] == 0
        chat = [{"role": "user", "content": "Count to three."}]
        async with PlannerClient(smol_stack.addr) as client:
            first = await client.generate_all(GenerateOptions(chat=chat, max_tokens=4, conversation_id="m1"))
            chat += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "Again."}]
            second = await client.generate_all(GenerateOptions(chat=chat, max_tokens=4, conversation_id="m1"))
        await smol_stack.wait_idle()
        after = await asyncio.to_thread(scrape, served.port)
    finally:
        smol_stack.planner.metrics = None
        served.stop()

    def grew(name: str, labels: tuple = ()) -> float:
        return after[(name, labels)] - before.get((name, labels), 0.0)

    assert grew("deltaserve_prompt_tokens_total") == first.prompt_tokens + second.prompt_tokens
    assert grew("deltaserve_generation_tokens_total") == len(first.token_ids) + len(second.token_ids)
    assert grew("deltaserve_requests_finished_total", (("reason", "length"),)) == 2
    assert second.checkpoint.startswith("checkpoint@") and second.reused_tokens > 0
    assert grew("deltaserve_prompt_tokens_reused_total", (("source", "checkpoint"),)) == second.reused_tokens
    assert grew("deltaserve_time_to_first_token_seconds_count") == 2
    assert grew("deltaserve_request_duration_seconds_count") == 2
    assert grew("deltaserve_request_queue_time_seconds_count") == 2
    assert (
        0
        < grew("deltaserve_request_queue_time_seconds_sum")
        < grew("deltaserve_request_duration_seconds_sum")
    )
    assert (
        grew("deltaserve_inter_token_latency_seconds_count")
        == len(first.token_ids) + len(second.token_ids) - 2
    )
    assert after[("deltaserve_kv_pages_used", ())] > 0  # the conversation keeps its pages


async def test_inter_token_latency_is_each_choices_own(monkeypatch):
    """n > 1 merges the choices' messages: a step's come side by side, which were read as gaps of 0 (a mean
    about n times too low). Each choice's gap is from its own previous message; its first tokens make none."""
    from planner_svc import metrics as planner_metrics
    from protos import client_pb2
    from protos.wire import pack_i32

    now = [0.0]
    monkeypatch.setattr(planner_metrics, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    registry = CollectorRegistry()
    clock = PlannerMetrics(registry).request()
    for now[0] in (1.0, 2.0, 3.0):  # each step, a token for each of two choices
        for index in (0, 1):
            clock.sent(client_pb2.GenerateResponse(token_ids=pack_i32([7]), index=index))
    count = registry.get_sample_value("deltaserve_inter_token_latency_seconds_count")
    total = registry.get_sample_value("deltaserve_inter_token_latency_seconds_sum")
    assert (count, total) == (4, 4.0)
    assert registry.get_sample_value("deltaserve_time_to_first_token_seconds_count") == 1


async def test_generation_tokens_count_while_the_stream_runs(smol_stack):
    """Counted as each message is written, not when the request ends: a long stream scraped half-way read 0
    while its client held hundreds of tokens."""
    from protos.wire import unpack_i32

    registry = CollectorRegistry()
    smol_stack.planner.metrics = PlannerMetrics(registry)
    served = serve_metrics(registry, "127.0.0.1", 0)
    long = GenerateOptions(text="Once upon a time", max_tokens=128, ignore_eos=True)
    received, mid_stream = 0, None
    try:
        await smol_stack.wait_idle()
        async with PlannerClient(smol_stack.addr) as client:
            async for response in client.generate(long):
                received += len(unpack_i32(response.token_ids))
                if mid_stream is None and received >= 8:  # the stream runs on: scraped now
                    scraped = await asyncio.to_thread(scrape, served.port)
                    mid_stream = (received, scraped[("deltaserve_generation_tokens_total", ())])
        await smol_stack.wait_idle()
        after = await asyncio.to_thread(scrape, served.port)
    finally:
        smol_stack.planner.metrics = None
        served.stop()
    assert mid_stream is not None and received == 128
    got, counted = mid_stream
    assert got <= counted < 128  # what the client had, and what was written and not yet read
    assert after[("deltaserve_generation_tokens_total", ())] == 128
