"""Pinned shared prefixes of Qwen3.5 hybrid conversations under state-slot pressure, over real gRPC with a cache
service: a resume short of state slots brings the pin's state back (not only the newest), every slot held by
pins' copies makes a new request park the coldest pinned conversation (its pin goes with its snapshot), and with
the cache gone the request is refused (RESOURCE_EXHAUSTED, saying what it needs, counted as a refusal) while
every pin holds."""

from __future__ import annotations

import grpc
import pytest
from prometheus_client import CollectorRegistry

from planner_svc.client import GenerateOptions, PlannerClient
from planner_svc.metrics import PlannerMetrics
from tests.conftest import stop_stack
from tests.hybrid_model import build_text_model, greedy, save_layouts, start_with_cache

pytestmark = pytest.mark.asyncio(loop_scope="session")

STATE_SLOTS = 4  # three for requests and checkpoints' copies
PIN = 10


def _prompt(name: str) -> list[int]:
    return [(7 * i + 31 * len(name) + ord(name[0])) % 500 + 3 for i in range(21)]


async def _start(root):
    from tests.hf_reference import hf_tokenizer

    model = build_text_model()
    model_dir, _ = save_layouts(model, str(root / "model"), hf_tokenizer())
    stack, servers, cache = await start_with_cache(
        model_dir, str(root / "cache"), STATE_SLOTS, row_check=True
    )
    return model, stack, servers, cache


def _conversation(stack, name: str):
    (conversation,) = [c for c in stack.scheduler.conversations.every() if c.conversation_id == name]
    return conversation


async def _pinned_and_parked(stack, client: PlannerClient, name: str) -> None:
    """A turn pinning the first PIN tokens (its pin's copy and its end's), then parked: no slot held."""
    options = GenerateOptions(
        token_ids=_prompt(name), max_tokens=3, conversation_id=name, shared_prefix={"tokens": PIN}
    )
    await client.generate_all(options)
    await stack.wait_idle()
    assert sorted(_conversation(stack, name).states) == [PIN, 23]
    assert (await client.park(name)).bytes > 0


async def test_pins_hold_through_resumes_short_of_slots_parking_and_a_refusal(tmp_path):
    model, stack, servers, cache = await _start(tmp_path)
    scheduler = stack.scheduler
    registry = CollectorRegistry()
    stack.planner.metrics = PlannerMetrics(registry)
    try:
        async with PlannerClient(stack.addr) as client:
            for name in ("a", "b", "c"):
                await _pinned_and_parked(stack, client, name)
            assert scheduler.states.free_count == STATE_SLOTS - 1
            assert (await client.resume("a")).checkpoints == [PIN, 23]  # two slots free: both states
            # One slot free: the pin's state comes back, not the newest's (retention never evicts a pin).
            assert (await client.resume("b")).checkpoints == [PIN]
            # None free: pressure takes a's newest copy, never a pin's, and c's pin comes back into it.
            assert (await client.resume("c")).checkpoints == [PIN]
            listed = {c.conversation_id: c for c in await client.conversations()}
            assert all((listed[n].checkpoints, listed[n].pinned_prefix) == ([PIN], PIN) for n in "abc")
            assert scheduler.states.free_count == 0
            # Every slot a pin's copy, nothing running: the request parks the coldest pinned conversation (a),
            # its pin in its snapshot, and runs.
            prompt = _prompt("new")
            got = await client.generate_all(GenerateOptions(token_ids=prompt, max_tokens=3))
            assert got.token_ids == greedy(model, prompt, 3)
            await stack.wait_idle()
            assert _conversation(stack, "a").parked and list(_conversation(stack, "b").states) == [PIN]
            assert (await client.resume("a")).checkpoints == [PIN]  # one slot free: the pin's state again
            # The cache gone, nothing can be parked: the request is refused rather than a pin dropped.
            await cache.stop(None)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await client.generate_all(GenerateOptions(token_ids=prompt, max_tokens=3))
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            # Never admitted: counted as Generate's refusals are, not as a request that ended in error.
            refusals = registry.get_sample_value(
                "deltaserve_requests_refused_total", {"code": "RESOURCE_EXHAUSTED"}
            )
            errors = registry.get_sample_value("deltaserve_requests_finished_total", {"reason": "error"})
            assert (refusals, errors) == (1.0, 0.0)
            assert refused.value.details() == (
                f"the request needs a free recurrent-state slot and none will come back: every one of the pool's "
                f"{STATE_SLOTS - 1} holds a checkpoint's state copy that pressure does not take back (3 of them "
                f"pinned shared prefixes', never evicted) and no request runs; delete (or park) a conversation "
                f"holding a pinned prefix, or give the executor more --state-slots"
            )
            for name in "abc":
                conversation = _conversation(stack, name)
                assert list(conversation.states) == [PIN] and conversation.retention.pinned == PIN
            # A pinned conversation's turn edited after its pin resumes from it once a slot is free.
            scheduler.return_pages(_conversation(stack, "c").forget())
            edited = _prompt("b")[:12] + [5, 5]
            got = await client.generate_all(
                GenerateOptions(token_ids=edited, max_tokens=3, conversation_id="b")
            )
            assert (got.reused_tokens, got.checkpoint, got.diverged_at) == (PIN, f"checkpoint@{PIN}", 12)
            assert got.token_ids == greedy(model, edited, 3)
            await stack.wait_idle()
            assert _conversation(stack, "b").retention.pinned == PIN and stack.engine.row_mismatches == 0
            scheduler.states.check()
    finally:
        await stop_stack(servers)
