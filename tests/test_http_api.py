"""The OpenAI-compatible HTTP API through OpenAI's own Python client, over the real stack (SmolLM2 on the
CPU) on loopback: the same greedy tokens as gRPC, streamed and whole; completions; models; health; conversation
ids no header can carry; a disconnect that frees pages; conversations and shared prefixes. Its errors:
tests/test_http_errors.py."""

from __future__ import annotations

import asyncio

import httpx2 as httpx
import openai
import pytest

from planner_svc.client import GenerateOptions
from tests.chat_streams import streaming_turn

pytestmark = pytest.mark.asyncio(loop_scope="session")

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


async def test_chat_streamed_and_whole_equal_the_grpc_tokens(http):
    grpc_answer = await http.planner.generate_all(GenerateOptions(chat=QUESTION, max_tokens=10))
    fields = dict(model=http.model, messages=QUESTION, max_tokens=10, temperature=0)
    whole = await http.client.chat.completions.create(**fields, extra_body={"return_token_ids": True})
    choice = whole.choices[0]
    assert choice.model_extra["token_ids"] == grpc_answer.token_ids
    assert choice.message.content == grpc_answer.text and choice.message.role == "assistant"
    assert choice.finish_reason == grpc_answer.finish_reason
    assert whole.usage.prompt_tokens == grpc_answer.prompt_tokens
    assert whole.usage.completion_tokens == len(grpc_answer.token_ids)
    # the same prompt again: its full pages come from the prefix index, and usage says so
    assert whole.usage.prompt_tokens_details.cached_tokens == whole.model_extra["deltaserve"]["reused_tokens"]

    stream = await http.client.chat.completions.create(
        **fields, stream=True, stream_options={"include_usage": True}, extra_body={"return_token_ids": True}
    )
    chunks = [chunk async for chunk in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed_ids = [i for c in chunks if c.choices for i in c.choices[0].model_extra["token_ids"]]
    assert streamed_ids == grpc_answer.token_ids
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == grpc_answer.text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [grpc_answer.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(grpc_answer.token_ids)
    assert all(c.usage is None for c in chunks[:-1])


async def test_completions_text_tokens_batch_and_stream(http):
    prompt = "The capital of France is"
    grpc_answer = await http.planner.generate_all(GenerateOptions(text=prompt, max_tokens=5))
    fields = dict(model=http.model, max_tokens=5, temperature=0)
    whole = await http.client.completions.create(prompt=prompt, **fields)
    assert whole.choices[0].text == grpc_answer.text and whole.object == "text_completion"
    ids = http.stack.planner.tokenizer(prompt)["input_ids"]
    by_ids = await http.client.completions.create(prompt=ids, **fields)
    assert by_ids.choices[0].text == grpc_answer.text
    batch = await http.client.completions.create(prompt=[prompt, "One, two, three,"], n=2, **fields)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert batch.choices[0].text == batch.choices[1].text == grpc_answer.text  # greedy: n alike
    assert batch.usage.prompt_tokens == len(ids) + len(
        http.stack.planner.tokenizer("One, two, three,")["input_ids"]
    )
    assert batch.usage.completion_tokens == 4 * 5
    stream = await http.client.completions.create(prompt=prompt, stream=True, **fields)
    assert "".join([c.choices[0].text async for c in stream]) == grpc_answer.text


async def test_models_health_and_the_openapi_schema(http):
    models = await http.client.models.list()
    assert [m.id for m in models.data] == [http.model]
    assert models.data[0].model_extra["max_model_len"] == http.stack.planner.description.max_seq_len
    assert await http.client.models.retrieve(http.model) == models.data[0]
    with pytest.raises(openai.NotFoundError, match="the model 'other/model' does not exist"):
        await http.client.models.retrieve("other/model")
    async with httpx.AsyncClient(base_url=http.base) as client:
        health = await client.get("/health")
        assert (health.status_code, health.json()) == (200, {"status": "serving"})
        schema = (await client.get("/openapi.json")).json()
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models", "/health"} <= set(schema["paths"])


async def test_the_served_model_name_is_the_one_listed_and_asked_for(http, monkeypatch):
    """--served-model-name: the API lists and takes that name; the checkpoint's own is then a 404."""
    monkeypatch.setattr(http.stack.planner, "model_name", "smollm2-135m")
    assert [m.id for m in (await http.client.models.list()).data] == ["smollm2-135m"]
    assert (await http.client.models.retrieve("smollm2-135m")).id == "smollm2-135m"
    messages = [{"role": "user", "content": "Hi"}]
    answer = await http.client.chat.completions.create(
        model="smollm2-135m", messages=messages, max_tokens=2, temperature=0
    )
    assert answer.model == "smollm2-135m"
    with pytest.raises(openai.NotFoundError, match="this server serves 'smollm2-135m'"):
        await http.client.chat.completions.create(model=http.model, messages=messages, max_tokens=2)


async def test_an_idle_pooled_connection_outlives_the_clients_pool_expiry(http):
    """The server keeps an idle connection past httpx's 5 s pool expiry, so a client never reuses one the
    server is closing; the same connection answers again after 6 s idle."""
    reader, writer = await asyncio.open_connection(*http.base.removeprefix("http://").split(":"))
    request = b"GET /health HTTP/1.1\r\nHost: deltaserve\r\n\r\n"
    try:
        for idle_s in (0, 6):
            await asyncio.sleep(idle_s)
            writer.write(request)
            status = await asyncio.wait_for(reader.readline(), 10)
            assert status.startswith(b"HTTP/1.1 200"), status
            headers = (await reader.readuntil(b"\r\n\r\n")).decode().lower()
            length = int(headers.split("content-length: ")[1].split("\r\n")[0])
            await reader.readexactly(length)
    finally:
        writer.close()


async def test_a_conversation_id_no_header_can_carry_is_answered_in_the_body_alone(http):
    """X-Conversation-Id echoes an id only where it can be a header value; any other (spaces at an end, a
    newline, non-ASCII) is answered in the body's deltaserve object, streamed or not, never a broken reply."""
    for conversation in (" c1 ", "a\nb", "naïve-日本"):
        body = {"model": http.model, "messages": QUESTION, "max_tokens": 2, "conversation_id": conversation}
        async with httpx.AsyncClient(base_url=http.base) as client:
            reply = await client.post("/v1/chat/completions", json=body)
            assert reply.status_code == 200, reply.text
            assert "x-conversation-id" not in reply.headers
            assert reply.json()["deltaserve"]["conversation_id"] == conversation
            async with client.stream(
                "POST", "/v1/chat/completions", json={**body, "stream": True}
            ) as streamed:
                assert streamed.status_code == 200 and "x-conversation-id" not in streamed.headers
                assert (await streamed.aread()).endswith(b"data: [DONE]\n\n")
    await http.stack.wait_idle()


async def test_a_client_that_disconnects_mid_stream_frees_its_pages(http):
    scheduler = http.stack.scheduler
    await http.stack.wait_idle()
    free_before = scheduler.pages.free_count
    body = {
        "model": http.model,
        "messages": QUESTION,
        "max_tokens": 2000,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    async with httpx.AsyncClient(base_url=http.base) as client, streaming_turn(client, body):
        assert http.stack.planner.running_requests  # it runs now
    # the connection closed: the planner aborts the request long before its 2000 tokens
    await http.stack.wait_idle(timeout=10)
    assert scheduler.pages.free_count == free_before and not http.stack.planner.running_requests


async def test_a_ten_turn_agent_conversation_reuses_its_history_every_turn(http):
    """Each turn resends the whole history with a conversation_id; its cached tokens cover the previous
    turn's prompt, every whole page of it (the planner resumes from the checkpoint the previous turn left,
    and keeps whole pages: a turn writes from a page boundary on)."""
    page = http.stack.planner.description.page_size
    history = [{"role": "system", "content": "You are a terse assistant."}]
    previous_prompt = 0
    for turn in range(10):
        history.append({"role": "user", "content": f"Step {turn}: say a number."})
        reply = await http.client.chat.completions.create(
            model=http.model,
            messages=history,
            max_tokens=4,
            temperature=0,
            extra_headers={"X-Conversation-Id": "agent-1"},
        )
        extension = reply.model_extra["deltaserve"]
        assert extension["conversation_id"] == "agent-1"
        cached = reply.usage.prompt_tokens_details.cached_tokens
        if turn:
            assert cached >= previous_prompt - previous_prompt % page, (
                turn,
                cached,
                previous_prompt,
                extension,
            )
            assert extension["checkpoint"].startswith("checkpoint@"), extension
        previous_prompt = reply.usage.prompt_tokens
        history.append({"role": "assistant", "content": reply.choices[0].message.content})


async def test_a_shared_prefix_is_pinned_for_the_conversation_or_logged(http):
    system = {"role": "system", "content": "You answer in one word. " * 8}
    reply = await http.client.chat.completions.create(
        model=http.model,
        messages=[system, *QUESTION],
        max_tokens=2,
        temperature=0,
        extra_body={"conversation_id": "pinned-1", "shared_prefix": {"messages": 1}},
    )
    extension = reply.model_extra["deltaserve"]
    assert extension["conversation_id"] == "pinned-1" and extension["pin_note"] is None
    assert 0 < extension["pinned_prefix"] < reply.usage.prompt_tokens
    # one that cannot be marked (past the prompt's end) is logged, and the request goes on
    past = await http.client.chat.completions.create(
        model=http.model,
        messages=[system, *QUESTION],
        max_tokens=2,
        temperature=0,
        extra_body={"conversation_id": "pinned-2", "shared_prefix": {"tokens": 100000}},
    )
    assert past.choices[0].message.content == reply.choices[0].message.content
    assert past.model_extra["deltaserve"]["pinned_prefix"] == 0
    assert past.model_extra["deltaserve"]["pin_note"].startswith("the shared prefix was not marked: ")
    listed = {c.conversation_id: c for c in await http.planner.conversations()}
    assert 0 < listed["pinned-1"].pinned_prefix < reply.usage.prompt_tokens
    assert listed["pinned-2"].pinned_prefix == 0
