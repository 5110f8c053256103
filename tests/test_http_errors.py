"""The OpenAI-compatible HTTP API's errors, over the real stack (SmolLM2 on the CPU) on loopback: each bad
request a 4xx with OpenAI's error object naming what is wrong, the gateway's own errors, bodies that are not
JSON or over the bound, a refused prompt in a streamed batch, a planner that does not answer (503) and a second
turn while the first streams (409)."""

from __future__ import annotations

import asyncio
import json

import httpx2 as httpx
import pytest

from gateway_svc.http_server import start_gateway
from tests.chat_streams import streaming_turn
from tests.test_http_api import QUESTION

pytestmark = pytest.mark.asyncio(loop_scope="session")


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
        (
            {
                "model": "{model}",
                "messages": QUESTION,
                "tools": [{"type": "function", "function": {"name": "f"}}],
                "tool_choice": {"type": "function", "function": {"name": "g"}},
            },
            400,
            "tool_choice",
            "naming one of the tools, got {'type': 'function', 'function': {'name': 'g'}}",
        ),
        (
            {"model": "{model}", "messages": QUESTION, "tools": [{"type": "function"}]},
            400,
            "tools",
            'each of tools must be {"type": "function", "function": {"name": ..., ...}}, named once',
        ),
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
            await client.post("/v1/chat/completions", json={**chat, "functions": [{"name": "f"}]}),
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
    async with httpx.AsyncClient(base_url=http.base) as client, streaming_turn(client, body):
        status, error = await _error(http, "/v1/chat/completions", {**body, "stream": False})
    assert (status, error["type"], error["code"]) == (409, "conflict_error", "failed_precondition")
    assert "already running a turn" in error["message"]
    await http.stack.wait_idle(timeout=10)
