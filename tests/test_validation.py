"""The planner's request checks (validation.py) and the UTF-8 guard (decode_guard.py), alone."""

from __future__ import annotations

import math

import pytest

from planner_svc.validation import (
    InvalidRequest,
    Limits,
    check_generate,
    check_length,
    check_min_tokens,
    longest_token_bytes,
    text_byte_limit,
    unset_max_tokens,
)
from protos import client_pb2
from protos.decode_guard import undecodable_field

LIMITS = Limits(vocab_size=100, max_seq_len=64, max_text_bytes=1000)


def request(**fields) -> client_pb2.GenerateRequest:
    sampling = fields.pop("sampling", {})
    fields.setdefault("max_tokens", 4)
    if not any(k in fields for k in ("text", "chat", "token_ids")):
        fields["text"] = "hi"
    return client_pb2.GenerateRequest(sampling=client_pb2.SamplingParams(**sampling), **fields)


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(sampling=dict(temperature=math.nan)), "sampling.temperature must be finite and in [0, 100]"),
        (dict(sampling=dict(temperature=math.inf)), "got inf"),
        (dict(sampling=dict(temperature=-math.inf)), "got -inf"),
        (dict(sampling=dict(temperature=-0.5)), "got -0.5"),
        (dict(sampling=dict(temperature=1000.0)), "sampling.temperature"),
        (dict(sampling=dict(top_p=math.nan)), "sampling.top_p must be in (0, 1], got nan"),
        (dict(sampling=dict(top_p=math.inf)), "sampling.top_p must be in (0, 1], got inf"),
        (dict(sampling=dict(top_p=0.0)), "top_p must be in (0, 1], got 0.0"),
        (dict(sampling=dict(top_k=-1)), "sampling.top_k must be >= 0 (0 is no cut), got -1"),
        (dict(max_tokens=-7), "max_tokens must be positive (or 0: up to the context's end), got -7"),
        (dict(max_tokens=10**9), "max_tokens 1000000000 leaves no room for a prompt"),
        (dict(stop_token_ids=[3, 100]), "stop_token_ids[1] is outside the vocabulary [0, 100), got 100"),
        (dict(stop_token_ids=[-2]), "stop_token_ids[0] is outside the vocabulary"),
        (dict(stop_token_ids=[1] * 2000), "stop_token_ids has 2000 ids; at most 1024"),
        (dict(text="x" * 1001), "text is 1001 bytes: more than the model's context of 64 tokens"),
        (
            dict(
                chat=client_pb2.ChatMessages(
                    messages=[client_pb2.ChatMessage(role="user", content="y" * 999)]
                )
            ),
            "chat is 1003 bytes",
        ),
        (
            dict(chat=client_pb2.ChatMessages(messages=[client_pb2.ChatMessage(role="", content="y")])),
            "chat.messages[0].role is empty",
        ),
        (
            dict(
                chat=client_pb2.ChatMessages(
                    messages=[client_pb2.ChatMessage(role="user", content="y", reasoning="z")]
                )
            ),
            "chat.messages[0].reasoning: only an assistant's message has a thought, not a 'user' one",
        ),
        (  # empty messages are few bytes, but each is a token or more once templated
            dict(chat=client_pb2.ChatMessages(messages=[client_pb2.ChatMessage(role="u")] * 65)),
            "chat has 65 messages: more than the model's context of 64 tokens could hold",
        ),
        (dict(token_ids=b"\x01\x00\x00"), "token_ids has 3 bytes: not packed int32"),
        (dict(token_ids=b"\x01\x00\x00\x00" * 64), "the prompt has 64 tokens; the model's context is 64"),
        (dict(request_id="r" * 300), "request_id has 300 characters; at most 256"),
        (dict(conversation_id="c" * 257), "conversation_id has 257 characters"),
        (
            dict(shared_prefix=client_pb2.SharedPrefix(tokens=-1), conversation_id="c"),
            "shared_prefix.tokens must be >= 0, got -1",
        ),
        (
            dict(shared_prefix=client_pb2.SharedPrefix(messages=99)),
            "shared_prefix pins the start of a conversation's history: give conversation_id too",
        ),
        (dict(sampling=dict(min_p=1.5)), "sampling.min_p must be in [0, 1] (0 is off), got 1.5"),
        (dict(sampling=dict(min_p=math.nan)), "sampling.min_p"),
        (dict(sampling=dict(repetition_penalty=0.0)), "sampling.repetition_penalty must be in [0.1, 10]"),
        (
            dict(sampling=dict(repetition_penalty=1e-30)),
            "repetition_penalty must be in [0.1",
        ),  # logits overflow
        (dict(sampling=dict(repetition_penalty=math.inf)), "sampling.repetition_penalty"),
        (
            dict(sampling=dict(frequency_penalty=2.5)),
            "sampling.frequency_penalty must be in [-2, 2], got 2.5",
        ),
        (dict(sampling=dict(presence_penalty=-3.0)), "sampling.presence_penalty must be in [-2, 2]"),
        (dict(sampling=dict(logit_bias={100: 1.0})), "sampling.logit_bias[100] names a token outside"),
        (dict(sampling=dict(logit_bias={5: 101.0})), "sampling.logit_bias[5] must be in [-100, 100]"),
        (dict(sampling=dict(logit_bias={5: math.nan})), "sampling.logit_bias[5]"),
        (
            dict(sampling=dict(logit_bias={i: 1.0 for i in range(301)})),
            "logit_bias has 301 entries; at most 300",
        ),
        (dict(stop=["a", "b", "c", "d", "e"]), "stop has 5 strings; at most 4"),
        (dict(stop=["ok", ""]), "stop[1] must have 1 to 256 characters"),
        (dict(min_tokens=5, max_tokens=4), "min_tokens must be in [0, max_tokens = 4], got 5"),
        (dict(min_tokens=-1), "min_tokens"),
        (dict(n=17), "n must be in [1, 16] (0 means 1), got 17"),
        (dict(n=-1), "n must be in"),
        (dict(n=2, conversation_id="c"), "n is 2 but a conversation's turn has one answer"),
        (dict(logprobs=True, top_logprobs=21), "top_logprobs must be in [0, 20], got 21"),
        (dict(top_logprobs=2), "top_logprobs is 2 but logprobs is off"),
        (dict(response_format=dict(json_object=False)), "response_format.json_object must be true"),
        (
            dict(response_format=dict(json_schema=dict(schema="{"))),
            "response_format.json_schema.schema is not JSON",
        ),
        (dict(response_format=dict(json_schema=dict(schema="[1]"))), "must be a JSON object"),
        (  # valid, but slow to compile: the depth is bounded
            dict(
                response_format=dict(
                    json_schema=dict(schema='{"type": "array", "items": ' * 64 + "{}" + "}" * 64)
                )
            ),
            "response_format.json_schema.schema nests deeper than 64 objects and arrays",
        ),
        (  # deeper than Python's JSON parser recurses
            dict(response_format=dict(json_schema=dict(schema='{"x": ' + "[" * 5000 + "]" * 5000 + "}"))),
            "response_format.json_schema.schema nests deeper than 64 objects and arrays",
        ),
        (  # valid, but its pattern would take the grammar compiler seconds
            dict(response_format=dict(json_schema=dict(schema='{"type": "string", "pattern": "c{12000}"}'))),
            "response_format.json_schema.schema has patterns whose counted repeats ({n}, {n,m}) add up to 12000",
        ),
        (  # the compiler's own refusal would say only "RuntimeError"
            dict(response_format=dict(json_schema=dict(schema='{"type": "integer", "minimum": 1e400}'))),
            "response_format.json_schema.schema has a number that is not finite (inf",
        ),
        (
            dict(response_format=dict(json_object=True), ignore_eos=True),
            "response_format and ignore_eos conflict",
        ),
        (
            dict(response_format=dict(json_schema=dict(schema="{}")), min_tokens=1),
            "response_format and min_tokens conflict: min_tokens 1 masks end-of-sequence",
        ),
    ],
)
def test_each_bad_field_is_named_with_its_value(fields, message):
    with pytest.raises(InvalidRequest) as caught:
        check_generate(request(**fields), LIMITS)
    assert message in str(caught.value)


def test_good_requests_pass():
    check_generate(request(), LIMITS)
    check_generate(request(sampling=dict(temperature=0.7, top_p=0.9, top_k=50, seed=2**64 - 1)), LIMITS)
    check_generate(request(text="x" * 1000, max_tokens=63, stop_token_ids=[0, 99]), LIMITS)
    check_generate(request(max_tokens=0), LIMITS)  # up to the context's end
    controls = dict(
        sampling=dict(
            temperature=1.0,
            min_p=0.1,
            repetition_penalty=1.2,
            frequency_penalty=-2.0,
            presence_penalty=2.0,
            logit_bias={0: -100.0, 99: 100.0},
        ),
        stop=["\n\n", "x" * 256, "a", "b"],
        min_tokens=4,
        n=16,
        logprobs=True,
        top_logprobs=20,
    )
    check_generate(request(**controls), LIMITS)
    grammar = dict(json_schema=dict(name="s", schema='{"type": "object"}', strict=True))
    check_generate(request(**(controls | dict(min_tokens=0, response_format=grammar))), LIMITS)
    check_generate(request(ignore_eos=True, min_tokens=2, response_format=dict()), LIMITS)  # no grammar


def test_a_schema_at_its_limits_passes():
    deep = '{"type": "array", "items": ' * 63 + "{}" + "}" * 63  # 64 objects deep
    check_generate(request(response_format=dict(json_schema=dict(schema=deep))), LIMITS)
    repeats = '{"type": "string", "pattern": "^[a-z]{4000}\\\\d{96}$"}'  # 4,096 repeats
    check_generate(request(response_format=dict(json_schema=dict(schema=repeats))), LIMITS)
    chat = client_pb2.ChatMessages(messages=[client_pb2.ChatMessage(role="u")] * 64)
    check_generate(request(chat=chat, max_tokens=1), LIMITS)


def test_a_tiny_temperature_passes_as_it_samples_greedy():
    check_generate(request(sampling=dict(temperature=1e-39)), LIMITS)  # intake makes it 0 (GREEDY_BELOW)


def test_min_tokens_within_the_rest_of_the_context():
    check_min_tokens(4, 4)
    with pytest.raises(
        InvalidRequest, match="min_tokens is 5: more than the 4 output tokens the context leaves"
    ):
        check_min_tokens(5, 4)


def test_an_unset_max_tokens_is_the_default_or_min_tokens_within_what_the_context_leaves():
    assert unset_max_tokens(prompt_len=8, max_seq_len=100, default=0, min_tokens=0) == 92  # all that fits
    assert unset_max_tokens(prompt_len=8, max_seq_len=100, default=5, min_tokens=0) == 5
    assert unset_max_tokens(prompt_len=97, max_seq_len=100, default=5, min_tokens=0) == 3
    assert unset_max_tokens(prompt_len=8, max_seq_len=100, default=5, min_tokens=7) == 7
    assert unset_max_tokens(prompt_len=97, max_seq_len=100, default=5, min_tokens=7) == 3  # then refused
    assert unset_max_tokens(prompt_len=100, max_seq_len=100, default=0, min_tokens=0) == 1  # then refused


def test_length_against_the_context():
    check_length(60, 4, 64)
    with pytest.raises(InvalidRequest, match="max_tokens at most 4"):
        check_length(60, 5, 64)
    with pytest.raises(InvalidRequest, match="the prompt has 64 tokens; the model's context is 64"):
        check_length(64, 1, 64)


def test_text_bound_covers_the_longest_token():
    class Vocab:
        def get_vocab(self):
            return {"a": 0, "ĊĠĠ": 1, "<|im_end|>": 2}

    assert longest_token_bytes(Vocab()) == 10
    assert text_byte_limit(8192, 162) == 8192 * 162 * 2


def test_invalid_utf8_is_found_and_named():
    good = client_pb2.GenerateRequest(
        request_id="a",
        chat=client_pb2.ChatMessages(
            messages=[
                client_pb2.ChatMessage(role="user", content="fine"),
                client_pb2.ChatMessage(role="user"),
            ]
        ),
        max_tokens=3,
    ).SerializeToString()
    assert undecodable_field(good, client_pb2.GenerateRequest.DESCRIPTOR) is None
    bad = good.replace(b"fine", b"f\xffne")
    assert (
        undecodable_field(bad, client_pb2.GenerateRequest.DESCRIPTOR)
        == "chat.messages[0].content is not valid UTF-8 (byte 0xff at offset 1)"
    )
    text = client_pb2.GenerateRequest(text="abc", max_tokens=1).SerializeToString().replace(b"abc", b"\xc3(c")
    assert undecodable_field(text, client_pb2.GenerateRequest.DESCRIPTOR).startswith(
        "text is not valid UTF-8"
    )
