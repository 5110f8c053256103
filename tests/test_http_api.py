"""The OpenAI-compatible HTTP API through OpenAI's own Python client, over the real stack (SmolLM2 on the
CPU) on loopback: the same greedy tokens as gRPC, streamed and whole; completions; models; health; the
errors; a disconnect that frees pages; conversations and shared prefixes."""

from __future__ import annotations

import asyncio
import json

import httpx2 as httpx
import pytest

from gateway_svc.http_server import start_gateway
from planner_svc.client import GenerateOptions

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
    async with httpx.AsyncClient(base_url=http.base) as client:
        health = await client.get("/health")
        assert (health.status_code, health.json()) == (200, {"status": "serving"})
        schema = (await client.get("/openapi.json")).json()
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models", "/health"} <= set(schema["paths"])


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


async def _error(http, path: str, body: dict, headers: dict | None = None) -> tuple[int, dict]:
    async with httpx.AsyncClient(base_url=http.base) as client:
        reply = await client.post(path, json=body, headers=headers)
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    return reply.status_code, error


@pytest.mark.parametrize(
    "body, status, param, says",
    [
        ({"model": "gpt-4", "messages": QUESTION}, 404, "model", "does not exist"),
        ({"messages": QUESTION}, 400, "model", "Field required"),
        ({"model": "{model}", "messages": []}, 400, "messages", "at least 1"),
        (
            {"model": "{model}", "messages": [{"role": "user"}], "max_tokens": 0},
            400,
            "max_tokens",
            "greater than or equal to 1",
        ),
        (
            {"model": "{model}", "messages": QUESTION, "temperature": -1},
            400,
            "temperature",
            "greater than or equal to 0",
        ),
        (
            {"model": "{model}", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            400,
            "messages.0.content",
            "only text content parts",
        ),
        ({"model": "{model}", "messages": QUESTION, "tools": [{"type": "function"}]}, 400, "tools", "tools"),
        ({"model": "{model}", "messages": QUESTION, "max_tokens": 9000}, 400, None, "context is 8192"),
        (
            {"model": "{model}", "messages": QUESTION, "shared_prefix": {"messages": 1}},
            400,
            "shared_prefix",
            "give a conversation_id",
        ),
        (
            {"model": "{model}", "messages": QUESTION, "conversation_id": "c", "shared_prefix": {"lines": 1}},
            400,
            "shared_prefix.lines",
            "Extra inputs",
        ),
        (
            {
                "model": "{model}",
                "messages": QUESTION,
                "conversation_id": "c",
                "shared_prefix": {"message": 0},
            },
            400,
            None,
            "shared_prefix must be",
        ),
        (
            {"model": "{model}", "messages": QUESTION, "conversation_id": "c", "n": 2},
            400,
            None,
            "a conversation's turn has one answer",
        ),
        # strict types: a boolean or a string is no number, a string no boolean; NaN no number
        ({"model": "{model}", "messages": QUESTION, "max_tokens": True}, 400, "max_tokens", "valid integer"),
        ({"model": "{model}", "messages": QUESTION, "max_tokens": "2"}, 400, "max_tokens", "valid integer"),
        ({"model": "{model}", "messages": QUESTION, "stream": "no"}, 400, "stream", "valid boolean"),
        ({"model": "{model}", "messages": QUESTION, "temperature": "0"}, 400, "temperature", "valid number"),
        (
            {"model": "{model}", "messages": QUESTION, "logit_bias": {"\u0663": 1}},  # an Arabic-Indic 3
            400,
            "logit_bias",
            "integers in ASCII digits",
        ),
        (
            {"model": "{model}", "messages": QUESTION, "logit_bias": {"1" * 4301: 1}},  # past int()'s digits
            400,
            "logit_bias",
            "integers in ASCII digits",
        ),
        (
            {"model": "{model}", "messages": [{"role": "user", "content": "Hi", "name": "alice"}]},
            400,
            "messages.0.name",
            "messages[0].name is not supported",
        ),
        (
            {"model": "{model}", "messages": [{"role": "user", "content": [{"type": "text"}]}]},
            400,
            "messages.0.content",
            "a text content part has no text",
        ),
    ],
)
async def test_each_bad_request_is_a_4xx_with_openais_error_object(http, body, status, param, says):
    if body.get("model") == "{model}":
        body = {**body, "model": http.model}
    got_status, error = await _error(http, "/v1/chat/completions", body)
    assert (got_status, error["param"]) == (status, param), error
    assert says in error["message"]
    await http.stack.wait_idle()


async def test_the_gateways_own_errors_carry_their_status_name_as_code(http):
    """As the planner's errors do: a malformed body, a field refused by name, an unknown path, a key no key can
    be, an oversized body; and the completions API's logprobs bound named as its own field."""
    chat = {"model": http.model, "messages": QUESTION}
    async with httpx.AsyncClient(base_url=http.base) as client:
        answers = [
            await client.post("/v1/chat/completions", json={"messages": QUESTION}),
            await client.post("/v1/chat/completions", json={**chat, "tools": [{"type": "function"}]}),
            await client.post("/v1/nothing", json=chat),
            await client.post(
                "/v1/chat/completions", json=chat, headers={"Authorization": "Bearer " + "k" * 20000}
            ),
            await client.post("/v1/completions", json={"model": http.model, "prompt": "Hi", "logprobs": 25}),
        ]
    codes = [(a.status_code, a.json()["error"]["code"]) for a in answers]
    assert codes == [
        (400, "invalid_argument"),
        (400, "invalid_argument"),
        (404, "not_found"),
        (401, "unauthenticated"),
        (400, "invalid_argument"),
    ], codes
    assert (
        "the API key has 20000 characters; no key has more than 1024" in answers[3].json()["error"]["message"]
    )
    assert answers[4].json()["error"]["message"] == "logprobs must be in [0, 20], got 25"
    nan = json.dumps({**chat, "temperature": float("nan")})  # Python's JSON parser reads the NaN literal
    async with httpx.AsyncClient(base_url=http.base) as client:
        reply = await client.post(
            "/v1/chat/completions", content=nan, headers={"content-type": "application/json"}
        )
    error = reply.json()["error"]
    assert (reply.status_code, error["param"]) == (400, "temperature") and "finite number" in error["message"]


async def test_a_lone_surrogate_and_a_body_not_sent_as_json_are_named(http):
    body = {"model": http.model, "messages": [{"role": "user", "content": "a\ud800b"}]}
    surrogate = json.dumps(body)  # as JSON escapes it: "a\\ud800b"
    async with httpx.AsyncClient(base_url=http.base) as client:
        unpaired = await client.post(
            "/v1/chat/completions", content=surrogate, headers={"content-type": "application/json"}
        )
        plain = await client.post(
            "/v1/chat/completions",
            content=json.dumps({"model": http.model, "messages": QUESTION}),
            headers={"content-type": "text/plain"},
        )
    assert unpaired.status_code == 400 and "lone surrogate" in unpaired.json()["error"]["message"]
    assert plain.status_code == 400
    assert plain.json()["error"]["message"] == "the body must be a JSON object sent as application/json"
    await http.stack.wait_idle()


async def test_a_body_over_the_bound_is_a_413_before_it_is_read_whole(http):
    from gateway_svc.body_limit import MAX_BODY_BYTES

    huge = b'{"model": "m", "messages": [{"role": "user", "content": "' + b"a" * MAX_BODY_BYTES + b'"}]}'

    async def chunked():  # no Content-Length: counted as it arrives
        for at in range(0, len(huge), 1 << 20):
            yield huge[at : at + (1 << 20)]

    async with httpx.AsyncClient(base_url=http.base, timeout=60) as client:
        for content in (huge, chunked()):
            reply = await client.post(
                "/v1/chat/completions", content=content, headers={"content-type": "application/json"}
            )
            error = reply.json()["error"]
            assert (reply.status_code, error["code"]) == (413, "resource_exhausted"), error
            assert f"over {MAX_BODY_BYTES} bytes" in error["message"]
    await http.stack.wait_idle()


async def test_a_streamed_batch_with_one_refused_prompt_is_refused_with_its_status(http):
    body = {"model": http.model, "prompt": ["Hi", "hello " * 9000], "max_tokens": 4, "stream": True}
    async with httpx.AsyncClient(base_url=http.base) as client:
        reply = await client.post("/v1/completions", json=body)
    assert reply.status_code == 400, reply.text
    assert "context is 8192" in reply.json()["error"]["message"]
    await http.stack.wait_idle()


async def test_conversation_header_and_body_must_agree_and_unknown_paths_are_404(http):
    body = {"model": http.model, "messages": QUESTION, "conversation_id": "a"}
    status, error = await _error(http, "/v1/chat/completions", body, {"X-Conversation-Id": "b"})
    assert status == 400 and "differ" in error["message"]
    status, error = await _error(http, "/v1/nothing", body)
    assert (status, error["type"]) == (404, "not_found_error")


async def test_a_body_that_is_not_json_is_a_400_and_a_wrong_method_a_405(http):
    async with httpx.AsyncClient(base_url=http.base) as client:
        reply = await client.post(
            "/v1/chat/completions", content=b'{"model": ', headers={"content-type": "application/json"}
        )
        error = reply.json()["error"]
        assert (reply.status_code, error["param"]) == (400, None), error
        assert "not valid JSON (at character 10)" in error["message"]
        reply = await client.get("/v1/chat/completions")
        assert (reply.status_code, reply.json()["error"]["type"]) == (405, "invalid_request_error")


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
    async with httpx.AsyncClient(base_url=http.base) as client:
        async with client.stream("POST", "/v1/chat/completions", json=body) as reply:
            assert reply.status_code == 200
            lines = reply.aiter_lines()
            while not (await anext(lines)).startswith("data: "):
                pass
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


async def test_a_planner_that_does_not_answer_is_503(http):
    gateway = await start_gateway("127.0.0.1:1")
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{gateway.port}") as client:
            health = await client.get("/health")
            reply = await client.post("/v1/chat/completions", json={"model": "m", "messages": QUESTION})
        assert (health.status_code, health.json()) == (503, {"status": "not_serving"})
        assert reply.status_code == 503 and reply.headers["retry-after"] == "1"
        assert reply.json()["error"]["type"] == "service_unavailable_error"
    finally:
        await asyncio.wait_for(gateway.stop(), 10)


async def test_a_second_turn_while_the_first_streams_is_a_409(http):
    body = {
        "model": http.model,
        "messages": QUESTION,
        "max_tokens": 300,
        "ignore_eos": True,
        "stream": True,
        "conversation_id": "busy",
    }
    async with httpx.AsyncClient(base_url=http.base) as client:
        async with client.stream("POST", "/v1/chat/completions", json=body) as reply:
            assert reply.status_code == 200
            lines = reply.aiter_lines()
            while not (await anext(lines)).startswith("data: "):
                pass
            status, error = await _error(http, "/v1/chat/completions", {**body, "stream": False})
    assert (status, error["type"], error["code"]) == (409, "conflict_error", "failed_precondition")
    assert "already running a turn" in error["message"]
    await http.stack.wait_idle(timeout=10)
