"""The sampling controls through the HTTP API (OpenAI's client, the real stack): stop strings split across
tokens, n choices with seeds, an unseeded answer's seed (the extension object's) repeating it, logprobs as the
planner's sampler reports them, the penalties forwarded, and response_format's JSON, and a schema feature it
cannot enforce (or xgrammar cannot compile) a 400 naming it, failing that request alone; vLLM's extensions it
cannot honour a 400 naming them."""

from __future__ import annotations

import asyncio

import grpc
import httpx2 as httpx
import openai
import pytest

from planner_svc.client import GenerateOptions
from tests.test_http_api import QUESTION
from tests.test_http_translate import VLLM_HARMLESS, VLLM_REFUSED

pytestmark = pytest.mark.asyncio(loop_scope="session")


async def test_a_stop_string_across_tokens_ends_the_answer_before_it(http):
    plain = await http.planner.generate_all(GenerateOptions(chat=QUESTION, max_tokens=12))
    words = http.stack.planner.tokenizer.convert_ids_to_tokens(plain.token_ids)
    assert len(words) > 4
    # the end of one token and the start of the next: a match no single token holds
    start = len(http.stack.planner.tokenizer.decode(plain.token_ids[:3], skip_special_tokens=True))
    stop = plain.text[start - 2 : start + 2]
    assert len(stop) == 4 and stop in plain.text
    fields = dict(model=http.model, messages=QUESTION, max_tokens=12, temperature=0, stop=[stop])
    whole = await http.client.chat.completions.create(**fields)
    choice = whole.choices[0]
    assert choice.message.content == plain.text[: plain.text.index(stop)]
    assert (choice.finish_reason, choice.model_extra["stop_reason"]) == ("stop", stop)
    stream = await http.client.chat.completions.create(**fields, stream=True)
    chunks = [c async for c in stream]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == choice.message.content
    assert chunks[-1].choices[0].finish_reason == "stop"


async def test_n_seeded_choices_differ_and_repeat(http):
    fields = dict(
        model=http.model,
        messages=QUESTION,
        max_tokens=6,
        temperature=1.5,
        n=2,
        seed=5,
        extra_body={"top_k": 50},
    )
    first = await http.client.chat.completions.create(**fields)
    again = await http.client.chat.completions.create(**fields)
    texts = [c.message.content for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1]
    assert texts == [c.message.content for c in again.choices]
    assert texts[0] != texts[1]
    assert 2 <= first.usage.completion_tokens <= 2 * 6  # every choice counted
    assert first.usage.prompt_tokens == again.usage.prompt_tokens  # the prompt counted once


async def test_an_unseeded_answer_reports_its_seed_which_repeats_it(http):
    """The extension object carries the seed the planner drew (whole and streamed); sent back, it repeats."""
    fields = dict(model=http.model, messages=QUESTION, max_tokens=8, temperature=1.5)
    first = await http.client.chat.completions.create(**fields)
    seed = first.model_extra["deltaserve"]["seed"]
    assert isinstance(seed, int)
    again = await http.client.chat.completions.create(**fields, seed=seed)
    assert again.model_extra["deltaserve"]["seed"] == seed
    assert again.choices[0].message.content == first.choices[0].message.content
    stream = await http.client.chat.completions.create(**fields, stream=True)
    chunks = [chunk async for chunk in stream]
    streamed = chunks[-1].model_extra["deltaserve"]["seed"]
    repeated = await http.client.chat.completions.create(**fields, seed=streamed)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == repeated.choices[0].message.content


async def test_logprobs_are_the_samplers(http):
    grpc_answer = await http.planner.generate_all(
        GenerateOptions(chat=QUESTION, max_tokens=5, logprobs=True, top_logprobs=3)
    )
    whole = await http.client.chat.completions.create(
        model=http.model, messages=QUESTION, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3
    )
    content = whole.choices[0].logprobs.content
    assert [e.logprob for e in content] == pytest.approx([e.chosen.logprob for e in grpc_answer.logprobs])
    assert [e.token for e in content] == [e.chosen.token for e in grpc_answer.logprobs]
    for entry in content:  # greedy: the chosen token is the most likely one
        assert len(entry.top_logprobs) == 3 and entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob >= entry.top_logprobs[2].logprob
    text = await http.client.completions.create(
        model=http.model, prompt="The capital of France is", max_tokens=4, temperature=0, logprobs=2
    )
    lp = text.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert "".join(lp.tokens) == text.choices[0].text and lp.text_offset[0] == 0


async def test_penalties_and_bias_are_forwarded_and_checked_by_the_planner(http):
    fields = dict(model=http.model, messages=QUESTION, max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="frequency_penalty"):
        await http.client.chat.completions.create(**fields, frequency_penalty=3.0)
    with pytest.raises(openai.BadRequestError, match="logit_bias keys must be token ids"):
        await http.client.chat.completions.create(**fields, logit_bias={"hello": 1.0})
    plain = await http.planner.generate_all(GenerateOptions(chat=QUESTION, max_tokens=2))
    banned = await http.client.chat.completions.create(
        **fields,
        temperature=0,
        logit_bias={str(plain.token_ids[0]): -100},
        extra_body={"return_token_ids": True},
    )
    assert banned.choices[0].model_extra["token_ids"][0] != plain.token_ids[0]


async def test_response_format_json_and_an_unsupported_schema_feature(http):
    answer = await http.client.chat.completions.create(
        model=http.model,
        messages=QUESTION,
        max_tokens=24,
        temperature=0,
        response_format={"type": "json_object"},
    )
    assert answer.choices[0].message.content.lstrip().startswith("{")
    text = await http.client.completions.create(  # a text completion takes it too (the SDK: extra_body)
        model=http.model,
        prompt="The capital of France is",
        max_tokens=24,
        temperature=0,
        extra_body={"response_format": {"type": "json_object"}},
    )
    assert text.choices[0].text.lstrip().startswith("{")
    schema = {"type": "object", "properties": {"a": {"type": "integer", "multipleOf": 3}}}
    with pytest.raises(openai.APIStatusError) as refused:
        await http.client.chat.completions.create(
            model=http.model,
            messages=QUESTION,
            max_tokens=2,
            response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
        )
    assert refused.value.status_code == 400 and "multipleOf" in refused.value.message
    for extra, fields in (({"min_tokens": 3}, "min_tokens"), ({"ignore_eos": True}, "ignore_eos")):
        with pytest.raises(openai.BadRequestError, match=f"response_format and {fields} conflict"):
            await http.client.chat.completions.create(
                model=http.model,
                messages=QUESTION,
                max_tokens=4,
                response_format={"type": "json_object"},
                extra_body=extra,
            )
    await http.stack.wait_idle()


async def test_a_schema_xgrammar_cannot_compile_fails_that_request_alone(http):
    """Refused at intake, by gRPC and HTTP, naming what xgrammar does not support, while another request runs
    on: its tokens as alone, and the executor never counted lost."""
    schema = {"type": "object", "properties": {"a": {"type": "string", "pattern": "(?<=x)y"}}}
    response_format = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}
    options = GenerateOptions(chat=QUESTION, max_tokens=8)
    alone = await http.planner.generate_all(options)
    losses = http.stack.engine.losses
    beside = asyncio.create_task(http.planner.generate_all(options))
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await http.planner.generate_all(
            GenerateOptions(chat=QUESTION, max_tokens=4, response_format=response_format)
        )
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details() == (
        "response_format.json_schema.schema cannot be compiled: Regex parsing error at position 3: "
        "Lookbehind is not supported yet."
    )
    with pytest.raises(openai.BadRequestError, match="cannot be compiled: Regex parsing error at position 3"):
        await http.client.chat.completions.create(
            model=http.model, messages=QUESTION, max_tokens=4, response_format=response_format
        )
    assert (await beside).token_ids == alone.token_ids
    assert http.stack.engine.losses == losses and http.stack.engine.failure is None


async def test_vllm_extensions_it_cannot_honour_are_a_400_naming_them(http):
    """A vLLM client's guided decoding, beam search, bad words, ... (and include_stop_str_in_output, which would
    keep the stop string vLLM returns) are refused by name, streamed or not, on both APIs: never a 200 with
    text they did not shape. Set to what asks for nothing, they pass and change nothing."""
    prompt = "The capital of France is Paris. The capital of Germany is"
    text = {"model": http.model, "prompt": prompt, "max_tokens": 6, "temperature": 0}
    chat = {"model": http.model, "messages": QUESTION, "max_tokens": 6, "temperature": 0}
    cases = [*VLLM_REFUSED, ("include_stop_str_in_output", True)]
    async with httpx.AsyncClient(base_url=http.base) as client:
        for (field, value), stream in zip(cases, [False, True] * len(cases)):
            for path, body in (("/v1/completions", text), ("/v1/chat/completions", chat)):
                extra = {field: value, "stop": [" Berlin"]} if field == "include_stop_str_in_output" else {}
                reply = await client.post(path, json={**body, "stream": stream, field: value, **extra})
                error = reply.json()["error"]
                assert (reply.status_code, error["param"], error["type"], error["code"]) == (
                    400,
                    field,
                    "invalid_request_error",
                    "invalid_argument",
                ), (path, field, reply.text)
                assert field in error["message"]
        plain = (await client.post("/v1/completions", json=text)).json()
        harmless = (await client.post("/v1/completions", json={**text, **VLLM_HARMLESS})).json()
    assert harmless["choices"][0]["text"] == plain["choices"][0]["text"]
