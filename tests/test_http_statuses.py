"""The HTTP statuses of the planner's refusals, end to end with OpenAI's client over a small keyed stack
(SmolLM2 on the CPU, 7 KV pages of 16 tokens, one request may wait): 400 for a request that can never fit and
429 with Retry-After for a full waiting queue (both RESOURCE_EXHAUSTED), the queue's limit kept by requests
arriving together and counted in choices, a batch sent a window of choices at a time, 403 for a tenant key acting for another
tenant (PERMISSION_DENIED, as over gRPC), and the service key acting for any tenant; the same for deleting a
conversation."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import grpc
import httpx2 as httpx
import openai
import pytest
import pytest_asyncio

from executor_svc.config import ExecutorConfig
from planner_svc.client import GenerateOptions, PlannerClient
from planner_svc.config import PlannerConfig
from protos.auth import parse_keys
from protos.rpc import NEVER_FITS_METADATA, ChannelSecurity, ServerSecurity
from tests.conftest import start_stack, stop_stack

pytestmark = pytest.mark.asyncio(loop_scope="session")

ALICE, SERVICE = "alice-status-key-0123456789", "service-status-key-0123456789"
QUESTION = [{"role": "user", "content": "Name a colour."}]


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def keyed():
    from gateway_svc.http_server import start_gateway

    stack, servers = await start_stack(
        ExecutorConfig(device="cpu", pool_pages=8, buckets=(1, 2), max_seq_len=512),
        PlannerConfig(max_waiting=1),
        ServerSecurity(keys=parse_keys(f"{ALICE} alice\n{SERVICE} *\n")),
    )
    gateway = await start_gateway(stack.addr)
    base = f"http://127.0.0.1:{gateway.port}/v1"
    client = openai.AsyncOpenAI(api_key=ALICE, base_url=base, max_retries=0)
    model = (await client.models.list()).data[0].id
    yield stack, client, base, model
    await gateway.stop()
    await stop_stack(servers)


async def test_a_request_that_can_never_fit_is_400_and_not_retried(keyed):
    """RESOURCE_EXHAUSTED marked as one no retry mends: OpenAI's client (its default retries on) asks once."""
    stack, _, base, model = keyed
    asked = []

    async def record(request: httpx.Request) -> None:
        asked.append(request.url)

    retrying = openai.AsyncOpenAI(
        api_key=ALICE, base_url=base, http_client=httpx.AsyncClient(event_hooks={"request": [record]})
    )
    with pytest.raises(openai.BadRequestError) as caught:  # 300 tokens: 19+ pages, the pool has 7
        await retrying.chat.completions.create(model=model, messages=QUESTION, max_tokens=300)
    assert caught.value.status_code == 400 and "retry-after" not in caught.value.response.headers
    assert "KV pages and the pool has 7" in caught.value.message
    assert (caught.value.body["type"], caught.value.body["code"]) == (
        "invalid_request_error",
        "resource_exhausted",
    )
    assert len(asked) == 1


async def test_a_batch_wider_than_the_waiting_queue_runs_a_window_at_a_time(keyed, monkeypatch):
    """Eight prompts against a queue of one: sent all at once they would fill it alone, and every retry too."""
    from gateway_svc import relay

    stack, _, base, model = keyed
    monkeypatch.setattr(relay, "BATCH_IN_FLIGHT", 1)
    await stack.wait_idle()
    async with httpx.AsyncClient(timeout=120, headers={"authorization": f"Bearer {ALICE}"}) as http:
        answer = await http.post(
            f"{base}/completions", json={"model": model, "prompt": ["Hi"] * 8, "max_tokens": 1}
        )
    assert answer.status_code == 200, answer.text
    assert sorted(choice["index"] for choice in answer.json()["choices"]) == list(range(8))


def _long(i: int = 0, n: int = 1) -> GenerateOptions:
    """6 of the 7 pages: none fits beside it."""
    return GenerateOptions(token_ids=[1 + i] * 8, max_tokens=80, ignore_eos=True, n=n)


async def _until(condition, what: str, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, what
        await asyncio.sleep(0.01)


async def test_a_full_waiting_queue_is_429(keyed, monkeypatch):
    stack, client, _, model = keyed
    async with (
        stack.free_pages_held(monkeypatch),
        PlannerClient(stack.addr, ChannelSecurity(api_key=ALICE)) as planner,
    ):
        waiting = asyncio.create_task(planner.generate_all(_long()))  # no pages: it waits
        await _until(lambda: stack.scheduler.waiting, "the request was not queued")
        with pytest.raises(
            openai.RateLimitError, match=r"waiting queue is full: 1 choice waits .*--max-waiting 1"
        ):
            await client.chat.completions.create(model=model, messages=QUESTION, max_tokens=2)
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
    await stack.wait_idle()


async def test_requests_arriving_together_wait_no_more_than_the_limit(keyed, monkeypatch):
    """The limit is checked before a request is tokenized and queued: those between the two count too, so a
    burst does not all pass it at once (10 queued for a limit of 8 were seen). The rest are refused, retryable,
    and nothing stays counted: refused, failed or cancelled, the queue takes `limit` again after."""
    stack, *_ = keyed
    limit, burst_size = 3, 10
    monkeypatch.setattr(stack.planner, "max_waiting", limit)
    prepare = stack.planner.intake.prepare

    async def slow_prepare(*args):  # a slow tokenizer (long prompts): the whole burst arrives while it reads
        await asyncio.sleep(0.3)
        return await prepare(*args)

    monkeypatch.setattr(stack.planner.intake, "prepare", slow_prepare)

    def long(i: int = 0, conversation_id: str = "") -> GenerateOptions:
        return replace(_long(i), conversation_id=conversation_id)

    async with PlannerClient(stack.addr, ChannelSecurity(api_key=ALICE)) as planner:
        async with stack.free_pages_held(monkeypatch):  # what is queued stays queued
            # Plain requests and conversations' first turns
            burst = [
                asyncio.create_task(planner.generate_all(long(i, f"burst-{i}" if i % 2 else "")))
                for i in range(1, burst_size + 1)
            ]
            await _until(
                lambda: sum(t.done() for t in burst) + len(stack.scheduler.waiting) >= burst_size,
                "the burst was neither queued nor refused",
            )
            assert len(stack.scheduler.waiting) == limit
            refused = [t.exception() for t in burst if t.done()]
            assert len(refused) == burst_size - limit
            for error in refused:
                assert isinstance(error, grpc.aio.AioRpcError)
                assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert f"queue is full: {limit} choices wait for admission (--max-waiting {limit})" in (
                    error.details()
                )
                assert NEVER_FITS_METADATA not in dict(error.trailing_metadata() or ())  # retryable
            assert stack.planner.starting == 0
            for task in burst:
                task.cancel()
            await asyncio.gather(*burst, return_exceptions=True)
            await stack.wait_idle()
            # Refused after the check: an empty prompt, one that never fits, a turn on a conversation running one
            for options, code in (
                (GenerateOptions(token_ids=[], max_tokens=1), grpc.StatusCode.INVALID_ARGUMENT),
                (GenerateOptions(token_ids=[1] * 8, max_tokens=300), grpc.StatusCode.RESOURCE_EXHAUSTED),
            ):
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await planner.generate_all(options)
                assert caught.value.code() == code
            turn = asyncio.create_task(planner.generate_all(long(conversation_id="busy")))
            await _until(
                lambda: stack.scheduler.waiting, "the turn was not queued"
            )  # its conversation is busy
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await planner.generate_all(long(conversation_id="busy"))
            assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            turn.cancel()
            await asyncio.gather(turn, return_exceptions=True)
            await stack.wait_idle()
            assert stack.planner.starting == 0
        # Nothing stays counted: a later request runs, and the queue takes `limit` again
        monkeypatch.setattr(stack.planner.intake, "prepare", prepare)
        assert (await planner.generate_all(GenerateOptions(token_ids=[5] * 4, max_tokens=2))).token_ids
        async with stack.free_pages_held(monkeypatch):
            queued = [asyncio.create_task(planner.generate_all(long(i))) for i in range(1, limit + 1)]
            await _until(lambda: len(stack.scheduler.waiting) == limit, "the queue did not take the limit")
            assert not any(t.done() for t in queued)
            for task in queued:
                task.cancel()
            await asyncio.gather(*queued, return_exceptions=True)
        for conversation in await planner.conversations():  # what the turns left: the pool whole again
            await planner.delete_conversation(conversation.conversation_id)
    await stack.wait_idle()


async def _refused(call) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, caught.value.details()
    return caught.value


async def test_the_waiting_queue_counts_a_request_by_its_choices(keyed, monkeypatch):
    """A request of n choices queues n (the later ones once the first has read the prompt): it takes room for n.
    It used to count as one, so the queue grew past the limit. Refused, retryable, when they do not fit now;
    refused at once, as one that never fits, when n alone is over the limit."""
    stack, client, _, model = keyed
    limit = 3
    monkeypatch.setattr(stack.planner, "max_waiting", limit)
    await stack.wait_idle()
    async with PlannerClient(stack.addr, ChannelSecurity(api_key=ALICE)) as planner:
        never = await _refused(
            planner.generate_choices(GenerateOptions(token_ids=[5] * 4, max_tokens=2, n=4))
        )
        assert f"n is 4: more choices than the waiting queue holds (--max-waiting {limit})" in never.details()
        assert dict(never.trailing_metadata() or ()).get(NEVER_FITS_METADATA) == "1"
        with pytest.raises(openai.BadRequestError, match="n is 4: more choices"):  # no retry mends it: 400
            await client.chat.completions.create(model=model, messages=QUESTION, max_tokens=2, n=4)
        async with stack.free_pages_held(monkeypatch):  # what is queued stays queued
            one = asyncio.create_task(planner.generate_all(_long(1)))
            await _until(lambda: len(stack.scheduler.waiting) == 1, "the request was not queued")
            # 1 waits: 3 more choices would make 4
            full = await _refused(planner.generate_choices(_long(2, n=3)))
            assert (
                f"queue is full: 1 choice waits for admission (--max-waiting {limit}), no room for this "
                "request's 3 choices; retry later" in full.details()
            )
            assert NEVER_FITS_METADATA not in dict(full.trailing_metadata() or ())
            # 2 more fit: the first queued, the second counted while it waits for the first to read the prompt
            pair = asyncio.create_task(planner.generate_choices(_long(3, n=2)))
            await _until(lambda: len(stack.scheduler.waiting) == 2, "the pair's first choice was not queued")
            assert stack.planner.starting == 1
            last = await _refused(planner.generate_all(_long(4)))
            assert (
                f"queue is full: 3 choices wait for admission (--max-waiting {limit}); retry"
                in last.details()
            )
            for task in (one, pair):
                task.cancel()
            await asyncio.gather(one, pair, return_exceptions=True)
    await stack.wait_idle()
    assert stack.planner.starting == 0  # the pair's second choice, never queued, counted no more


async def test_a_batch_window_counts_choices(keyed, monkeypatch):
    """A completions batch keeps BATCH_IN_FLIGHT choices in flight, not calls: the queue counts choices, so two
    calls of two choices against a queue of two would have the second refused (429) and the batch with it."""
    from gateway_svc import relay

    stack, _, base, model = keyed
    monkeypatch.setattr(relay, "BATCH_IN_FLIGHT", 2)
    monkeypatch.setattr(stack.planner, "max_waiting", 2)
    prepare = stack.planner.intake.prepare

    async def slow_prepare(*args):  # every call in flight passes the check before the first is queued
        await asyncio.sleep(0.3)
        return await prepare(*args)

    monkeypatch.setattr(stack.planner.intake, "prepare", slow_prepare)
    await stack.wait_idle()
    async with httpx.AsyncClient(timeout=120, headers={"authorization": f"Bearer {ALICE}"}) as http:
        answer = await http.post(
            f"{base}/completions", json={"model": model, "prompt": ["Hi"] * 4, "n": 2, "max_tokens": 1}
        )
    assert answer.status_code == 200, answer.text
    assert sorted(choice["index"] for choice in answer.json()["choices"]) == list(range(8))
    await stack.wait_idle()


async def test_a_tenant_key_naming_another_tenant_is_403(keyed):
    _, client, base, model = keyed
    fields = dict(model=model, messages=QUESTION, max_tokens=1)
    with pytest.raises(openai.PermissionDeniedError) as caught:
        await client.chat.completions.create(**fields, extra_body={"tenant": "bob"})
    assert caught.value.status_code == 403 and caught.value.body["type"] == "permission_error"
    assert "names a tenant other than its API key's" in caught.value.message
    assert (await client.chat.completions.create(**fields, extra_body={"tenant": "alice"})).choices
    service = openai.AsyncOpenAI(api_key=SERVICE, base_url=base, max_retries=0)
    assert (await service.chat.completions.create(**fields, extra_body={"tenant": "bob"})).choices


async def test_the_model_list_asks_for_a_key_every_time(keyed):
    """/v1/models (and a model by name) checks each caller's key: one allowed caller does not open it to
    everyone after."""
    _, client, base, model = keyed
    assert (await client.models.list()).data and (await client.models.retrieve(model)).id == model
    for key in (None, "wrong-key-0123456789"):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        async with httpx.AsyncClient() as http:
            for path in ("/models", f"/models/{model}"):
                reply = await http.get(f"{base}{path}", headers=headers)
                assert (reply.status_code, reply.json()["error"]["type"]) == (401, "authentication_error")


async def test_a_key_no_key_can_be_is_401(keyed):
    _, _, base, model = keyed
    body = {"model": model, "messages": QUESTION, "max_tokens": 1}
    async with httpx.AsyncClient() as http:
        for key in ("k\u00e9y".encode(), f"{ALICE}\x7f".encode()):
            reply = await http.post(
                f"{base}/chat/completions", json=body, headers={b"Authorization": b"Bearer " + key}
            )
            assert reply.status_code == 401, reply.text
            assert "printable ASCII" in reply.json()["error"]["message"]


async def test_a_conversation_is_deleted_by_its_tenant_or_the_service_key_for_it(keyed):
    stack, client, base, model = keyed
    await client.chat.completions.create(
        model=model, messages=QUESTION, max_tokens=1, extra_body={"conversation_id": "owned"}
    )
    await stack.wait_idle()
    async with httpx.AsyncClient(base_url=base) as http:

        async def delete(key: str, tenant: str = "") -> httpx.Response:
            params = {"tenant": tenant} if tenant else None
            return await http.delete(
                "/conversations/owned", params=params, headers={"Authorization": f"Bearer {key}"}
            )

        named_other = await delete(ALICE, "bob")
        assert (named_other.status_code, named_other.json()["error"]["type"]) == (403, "permission_error")
        assert (await delete(SERVICE, "bob")).status_code == 404  # bob has none of that id
        assert (await delete("wrong-key-0123456789")).status_code == 401
        assert stack.scheduler.conversations.get("alice", "owned") is not None
        assert (await delete(SERVICE, "alice")).json()["deleted"] is True
        assert (await delete(ALICE)).status_code == 404
    assert stack.scheduler.pages.free_count == stack.scheduler.pages.total
