"""A reasoning model's thought apart from its answer (`reasoning`, or `reasoning_content`): the split of a whole
text, the stream agreeing with it however the text is cut, thoughts and tool calls together, where the planner
finds a prompt opened a thought; and over the real stack (SmolLM2 served with a template that opens a thought
when asked) the thought split whole and streamed, for each choice; not split with thinking off, for an answer
held to JSON, or with --reasoning-field none."""

from __future__ import annotations

import json
import random

import httpx2 as httpx
import pytest

from gateway_svc.openai_schema import ChatCompletionBody
from gateway_svc.reasoning import ThoughtStream, split_thought
from gateway_svc.tool_calls import ToolSpec
from gateway_svc.translate import BadField, chat_choices
from planner_svc.tokenizer import begins_in_thought, chat_ids
from protos import client_pb2
from protos.model_files import load_tokenizer
from tests.choice_replies import both

CASES = [
    # (text, the prompt opened a thought, thought, content)
    ("plan\n</think>\n\nHello", True, "plan\n", "\n\nHello"),
    ("<think>\nplan</think>Hello", False, "\nplan", "Hello"),  # the model opens it (Qwen3)
    ("<think>\nplan</think>Hello", True, "\nplan", "Hello"),  # and again, where the prompt did (R1 may)
    ("  plan</think>Hello", True, "  plan", "Hello"),
    (" \n<think>plan</think>Hello", False, "plan", "Hello"),  # white space before the tag is not content
    ("still thinking", True, "still thinking", ""),  # cut by max_tokens inside the thought
    ("<think>still", False, "still", ""),
    ("Hello <think>not a thought</think>", False, None, "Hello <think>not a thought</think>"),
    ("<thi", False, None, "<thi"),  # a tag begun and never finished: text
    ("<think></think>Hello", False, None, "Hello"),  # an empty thought: none
    ("a</think>b</think>c", True, "a", "b</think>c"),  # the first end ends it
    ("", False, None, ""),
    ("  ", False, None, "  "),
]


@pytest.mark.parametrize("text, opened, thought, content", CASES)
def test_a_whole_text_splits_into_thought_and_content(text, opened, thought, content):
    assert split_thought(text, opened) == (thought, content)


@pytest.mark.parametrize("text, opened, thought, content", CASES)
def test_the_stream_agrees_with_the_whole_however_the_text_is_cut(text, opened, thought, content):
    cuts = [[text[:at], text[at:]] for at in range(len(text) + 1)] + [list(text)]
    for pieces in cuts:
        stream = ThoughtStream(opened)
        sent = [stream.feed(piece) for piece in pieces] + [stream.finish()]
        assert "".join(t for t, _ in sent) == (thought or "")
        assert "".join(c for _, c in sent) == content


def test_a_thought_is_sent_as_it_comes_less_what_may_end_it():
    stream = ThoughtStream(True)
    assert stream.feed("Let me see") == ("Let me see", "")
    assert stream.feed(". </th") == (". ", "")  # may be the end tag: held
    assert stream.feed("ink>Hi") == ("", "Hi")
    assert stream.feed(" there") == ("", " there")


USER = {"role": "user", "content": "Hi"}
SPEC = ToolSpec({"get_weather": {"type": "object", "properties": {"city": {"type": "string"}}}})
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'


def test_whole_and_streamed_answers_carry_the_same_thought_and_content():
    pieces = ["I should", " greet.</th", "ink>\n\nHel", "lo!"]
    for field in ("reasoning", "reasoning_content"):
        result = both(pieces, client_pb2.FINISH_REASON_STOP, reasoning_field=field, begins_in_thought=True)
        message = result.answer["message"]
        assert (message[field], message["content"]) == ("I should greet.", "\n\nHello!")
        assert (result.thought, result.content) == ("I should greet.", "\n\nHello!")
    dropped = both(  # vLLM's include_reasoning: false
        pieces,
        client_pb2.FINISH_REASON_STOP,
        reasoning_field="reasoning",
        include_reasoning=False,
        begins_in_thought=True,
    )
    assert dropped.answer["message"]["reasoning"] is None and dropped.thought == ""
    assert dropped.answer["message"]["content"] == dropped.content == "\n\nHello!"
    plain = both(pieces, client_pb2.FINISH_REASON_STOP, begins_in_thought=True)  # --reasoning-field none
    assert set(plain.answer["message"]) == {"role", "content"}
    assert plain.answer["message"]["content"] == plain.content == "".join(pieces)


def test_a_call_in_the_thought_is_thought_and_one_after_it_a_call():
    pieces = ["Maybe ", CALL[:20], CALL[20:], "? Yes.</think>", "\n", CALL]
    result = both(
        pieces, client_pb2.FINISH_REASON_STOP, spec=SPEC, reasoning_field="reasoning", begins_in_thought=True
    )
    message = result.answer["message"]
    assert message["reasoning"] == result.thought == f"Maybe {CALL}? Yes."
    assert message["content"] is None and result.content == ""  # white space alone before the call
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather"]
    assert [c["function"]["name"] for c in result.calls] == ["get_weather"]
    assert result.finish == result.answer["finish_reason"] == "tool_calls"


def test_the_planner_finds_a_prompt_that_opens_a_thought():
    from tests.chat_templates import TOOLS_TEMPLATE

    tokenizer = load_tokenizer(None)
    tokenizer.chat_template = TOOLS_TEMPLATE
    messages = [{"role": "user", "content": "Hi"}]
    found = {
        thinking: begins_in_thought(tokenizer, chat_ids(tokenizer, messages, {"enable_thinking": thinking}))
        for thinking in (True, False)
    }
    assert found == {True: True, False: False}  # off: the template closes an empty thought
    assert not begins_in_thought(tokenizer, chat_ids(tokenizer, messages, {}))
    named = [{"role": "user", "content": "What does <think> do? <think>"}]  # the tag in a message opens none
    assert not begins_in_thought(tokenizer, chat_ids(tokenizer, named, {}))


def test_a_thought_sent_back_in_the_history_goes_to_the_planner_under_one_name():
    thought = "The user greets."
    for name in ("reasoning", "reasoning_content"):
        said = {"role": "assistant", "content": "Hello!", name: thought}
        body = ChatCompletionBody.model_validate({"model": "m", "messages": [USER, said, USER]})
        [choice] = chat_choices(body, None, "r")
        assert choice.options.chat[1] == {"role": "assistant", "content": "Hello!", "reasoning": thought}
    for message, field, says in (
        ({**USER, "reasoning": "x"}, "messages.0.reasoning", "only an assistant's message has a thought"),
        ({"role": "assistant", "content": "", "reasoning": "a", "reasoning_content": "b"}, None, "differ"),
    ):
        body = ChatCompletionBody.model_validate({"model": "m", "messages": [message]})
        with pytest.raises(BadField, match=says) as refused:
            chat_choices(body, None, "r")
        assert field is None or refused.value.param == field


# ---- over the stack ----


async def _answers(port: int, body: dict) -> tuple[dict, tuple[str, str]]:
    """The whole answer's message, and the stream's (thought, content)."""
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
        whole = (await client.post("/v1/chat/completions", json=body)).json()["choices"][0]["message"]
        thought, content = [], []
        async with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as reply:
            async for line in reply.aiter_lines():
                if line.startswith("data: {"):
                    delta = json.loads(line[6:])["choices"][0]["delta"]
                    thought.append(delta.get("reasoning") or "")
                    content.append(delta.get("content") or "")
    return whole, ("".join(thought), "".join(content))


@pytest.mark.asyncio(loop_scope="session")
async def test_a_thought_the_template_opens_is_reasoning_whole_and_streamed(templated):
    from gateway_svc.http_server import start_gateway

    body = {
        "model": templated.model,
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 8,
        "temperature": 0,
    }
    thinking = {**body, "chat_template_kwargs": {"enable_thinking": True}}
    whole, streamed = await _answers(templated.gateway.port, thinking)
    assert whole["reasoning"] and whole["content"] == ""  # SmolLM2 never closes the thought
    assert streamed == (whole["reasoning"], "")
    dropped, dropped_streamed = await _answers(
        templated.gateway.port, {**thinking, "include_reasoning": False}
    )
    assert (dropped["reasoning"], dropped["content"], dropped_streamed) == (None, "", ("", ""))
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{templated.gateway.port}", timeout=60) as client:
        reply = await client.post(
            "/v1/chat/completions", json={**thinking, "n": 2, "temperature": 1, "seed": 7}
        )
    assert [bool(c["message"]["reasoning"]) for c in reply.json()["choices"]] == [True, True]
    assert [c["message"]["content"] for c in reply.json()["choices"]] == ["", ""]  # each choice begins in it
    plain = await start_gateway(templated.stack.addr, reasoning_field=None)
    try:
        raw, raw_streamed = await _answers(plain.port, thinking)
    finally:
        await plain.stop()
    assert "reasoning" not in raw and raw["content"] == whole["reasoning"]
    assert raw_streamed == ("", raw["content"])
    off, off_streamed = await _answers(
        templated.gateway.port, {**body, "chat_template_kwargs": {"enable_thinking": False}}
    )
    assert off["reasoning"] is None and off["content"]
    assert off_streamed == ("", off["content"])
    held, held_streamed = await _answers(
        templated.gateway.port, {**thinking, "response_format": {"type": "json_object"}}
    )  # held to JSON from its first token, the model writes no thought
    assert held["reasoning"] is None and held["content"].lstrip().startswith("{")
    assert held_streamed == ("", held["content"])


@pytest.mark.asyncio(loop_scope="session")
async def test_a_thought_in_the_history_is_rendered_by_the_chat_template(templated):
    messages = [USER, {"role": "assistant", "content": "Hello!"}, USER]
    thought = {**messages[1], "reasoning": "The user greets; greet back."}
    counts = []
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{templated.gateway.port}", timeout=60) as client:
        for history in (messages, [USER, thought, USER]):
            body = {"model": templated.model, "messages": history, "max_tokens": 1}
            counts.append(
                (await client.post("/v1/chat/completions", json=body)).json()["usage"]["prompt_tokens"]
            )
    tokenizer = templated.stack.planner.tokenizer
    rendered = chat_ids(
        tokenizer, [USER, {**messages[1], "reasoning_content": thought["reasoning"]}, USER], {}
    )
    assert counts[1] == len(rendered) > counts[0]  # given to the template as reasoning_content


FRAGMENTS = [
    "<think>",
    "</think>",
    "plan",
    " ",
    "\n",
    "<tool_call>",
    "</tool_call>",
    CALL,
    "{",
    "}",
    ";",
    "é😀",
    '"x"',
]
BARE = '{"name": "get_weather", "parameters": {"city": "Oslo"}}'


@pytest.mark.parametrize("seed", range(6))
def test_streamed_and_whole_answers_agree_on_random_texts_cut_at_random(seed):
    """Texts of tags, calls (tagged and bare), JSON marks and white space, cut into pieces of 1 to 3 characters:
    the stream's content, thought, calls and finish reason are the whole answer's, whatever the options."""
    rng = random.Random(seed)
    for _ in range(100):
        text = "".join(rng.choice(FRAGMENTS) for _ in range(rng.randrange(0, 6)))
        text += rng.choice(["", "</think>", "</think>\n"]) + rng.choice(["", BARE, CALL, f"{BARE}; {BARE}"])
        pieces, at = [], 0
        while at < len(text):
            pieces.append(text[at : (at := at + rng.randrange(1, 4))])
        pieces = pieces or [""]
        options = dict(
            spec=rng.choice([None, SPEC]),
            reasoning_field=rng.choice([None, "reasoning"]),
            begins_in_thought=rng.random() < 0.5,
        )
        result = both(
            pieces, rng.choice([client_pb2.FINISH_REASON_STOP, client_pb2.FINISH_REASON_LENGTH]), **options
        )
        message = result.answer["message"]
        assert (message["content"] or "", message.get("reasoning") or "") == (
            result.content,
            result.thought,
        ), text
        assert [c["function"] for c in message.get("tool_calls", ())] == [c["function"] for c in result.calls]
        assert result.finish == result.answer["finish_reason"], text
