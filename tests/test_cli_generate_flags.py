"""`deltaserve generate`'s flags: exactly one prompt (flag, variable or chat file), numbers the wire cannot
hold and unreadable JSON files as usage errors, sampling and stop flags, the conversation, tenant and
shared prefix, and the sampling controls made a request."""

from __future__ import annotations

import json

import pytest

from deltaserve import commands
from planner_svc.client import build_generate_request
from tests.cli_helpers import parse, usage_error


def test_generate_takes_exactly_one_prompt(capsys, tmp_path):
    args = parse(["generate", "--token-ids", "1, 2,3", "--max-tokens", "4"])
    assert (args.token_ids, args.text, args.chat, args.temperature, args.top_p, args.top_k) == (
        [1, 2, 3],
        None,
        None,
        0.0,
        1.0,
        0,
    )
    assert "required" in usage_error(capsys, ["generate", "--max-tokens", "4"])
    assert "not allowed with" in usage_error(
        capsys, ["generate", "--text", "a", "--token-ids", "1", "--max-tokens", "4"]
    )
    assert "--max-tokens" in usage_error(capsys, ["generate", "--text", "a"])
    assert parse(["generate"], DELTASERVE_TEXT="hi", DELTASERVE_MAX_TOKENS="3").text == "hi"
    assert parse(["generate", "--max-tokens", "3"], DELTASERVE_TOKEN_IDS="7,8").token_ids == [7, 8]
    from_cli = parse(["generate", "--text", "cli", "--max-tokens", "3"], DELTASERVE_TOKEN_IDS="7,8")
    assert (from_cli.text, from_cli.token_ids) == ("cli", None)
    assert "more than one prompt" in usage_error(
        capsys, ["generate", "--max-tokens", "3"], DELTASERVE_TEXT="a", DELTASERVE_TOKEN_IDS="1"
    )

    chat = [{"role": "user", "content": "hello"}]
    chat_file = tmp_path / "chat.json"
    chat_file.write_text(json.dumps(chat))
    assert parse(["generate", "--chat-json", str(chat_file), "--max-tokens", "3"]).chat == chat
    chat_file.write_text(json.dumps([{"role": "user"}]))
    assert "--chat-json" in usage_error(
        capsys, ["generate", "--chat-json", str(chat_file), "--max-tokens", "3"]
    )
    assert "--chat-json" in usage_error(
        capsys, ["generate", "--chat-json", str(tmp_path / "missing"), "--max-tokens", "3"]
    )


def test_generate_chat_template_kwargs_go_with_a_chat(capsys, tmp_path):
    chat_file = tmp_path / "chat.json"
    chat_file.write_text(json.dumps([{"role": "user", "content": "hello"}]))
    flags = ["generate", "--chat-json", str(chat_file), "--max-tokens", "3"]
    args = parse([*flags, "--chat-template-kwargs", '{"enable_thinking": false}'])
    request = build_generate_request(commands._request_options(args))
    assert json.loads(request.chat.template_kwargs) == {"enable_thinking": False}
    assert parse(flags, DELTASERVE_CHAT_TEMPLATE_KWARGS='{"a": 1}').chat_template_kwargs == {"a": 1}
    assert "expected a JSON object" in usage_error(capsys, [*flags, "--chat-template-kwargs", "[1]"])
    text = ["generate", "--text", "a", "--max-tokens", "3"]
    assert "give --chat-json" in usage_error(capsys, [*text, "--chat-template-kwargs", '{"a": 1}'])
    assert parse(text, DELTASERVE_CHAT_TEMPLATE_KWARGS='{"a": 1}').chat_template_kwargs is None  # chats' only


@pytest.mark.parametrize(
    "flags, said",
    [
        (["--max-tokens", "3000000000"], "--max-tokens: expected an integer in 1..2147483647"),
        (["--seed", str(2**64)], "--seed: expected an integer in 0..18446744073709551615"),
        (["--top-k", "3000000000"], "--top-k: expected an integer in 0..2147483647"),
        (["--logit-bias", "3000000000:1"], "--logit-bias: expected token ids in 0..2147483647"),
        (["--stop-token-ids", "3000000000"], "--stop-token-ids: expected integers that fit in 32 bits"),
        (["--repetition-penalty", "1e-39"], "--repetition-penalty: expected a number in [0.1, 10]"),
        (["--shared-prefix", "tokens:99999999999"], "--shared-prefix: expected numbers that fit in 32 bits"),
    ],
)
def test_generate_numbers_the_wire_cannot_hold_are_usage_errors(capsys, flags, said):
    """Not a traceback from the protobuf encoder once the request is built."""
    argv = ["generate", "--text", "a", "--max-tokens", "3", *flags]
    assert said in usage_error(capsys, argv)


def test_generate_unreadable_json_files_are_usage_errors(capsys, tmp_path):
    not_utf8, deep = tmp_path / "bytes.json", tmp_path / "deep.json"
    not_utf8.write_bytes(b"\xff")
    deep.write_text("[" * 100_000 + "]" * 100_000)
    for path in (not_utf8, deep):
        chat = usage_error(capsys, ["generate", "--chat-json", str(path), "--max-tokens", "3"])
        schema = usage_error(
            capsys, ["generate", "--text", "a", "--max-tokens", "3", "--json-schema", str(path)]
        )
        assert f"--chat-json {path}:" in chat and "Traceback" not in chat
        assert "--json-schema: cannot read a JSON schema" in schema and "Traceback" not in schema
    assert "nests too deep" in usage_error(
        capsys, ["generate", "--chat-json", str(deep), "--max-tokens", "3"]
    )


def test_generate_sampling_and_stop_flags():
    args = parse(
        [
            "generate",
            "--text",
            "a",
            "--max-tokens",
            "5",
            "--temperature",
            "0.7",
            "--top-p",
            "0.9",
            "--top-k",
            "40",
            "--seed",
            "7",
            "--stop-token-ids",
            "2,5",
            "--stop-token-ids",
            "9",
            "--ignore-eos",
            "--json",
            "--request-id",
            "r-1",
        ]
    )
    assert (args.temperature, args.top_p, args.top_k, args.seed) == (0.7, 0.9, 40, 7)
    assert parse(["generate", "--text", "a", "--max-tokens", "5"]).seed is None  # the planner draws one
    assert (args.stop_token_ids, args.ignore_eos, args.json, args.request_id) == (
        [2, 5, 9],
        True,
        True,
        "r-1",
    )
    assert parse(
        ["generate", "--text", "a", "--max-tokens", "5"], DELTASERVE_STOP_TOKEN_IDS="3"
    ).stop_token_ids == [3]


def test_generate_conversation_tenant_and_shared_prefix(capsys):
    base = ["generate", "--text", "a", "--max-tokens", "1"]
    args = parse([*base, "--conversation", "c1", "--tenant", "t", "--shared-prefix", "messages:2"])
    assert (args.conversation, args.tenant, args.shared_prefix) == ("c1", "t", {"messages": 2})
    assert parse([*base, "--conversation", "c", "--shared-prefix", "message:1:40"]).shared_prefix == {
        "message": 1,
        "chars": 40,
    }
    assert parse([*base], DELTASERVE_CONVERSATION="c", DELTASERVE_SHARED_PREFIX="tokens:9").shared_prefix == {
        "tokens": 9
    }
    plain = parse(base)
    assert (plain.conversation, plain.tenant, plain.shared_prefix) == (None, "", None)
    for bad in ("messages", "messages:-1", "message:1", "tokens:x", "chars:3"):
        assert "--shared-prefix" in usage_error(
            capsys, [*base, "--conversation", "c", "--shared-prefix", bad]
        )
    assert "give --conversation" in usage_error(capsys, [*base, "--shared-prefix", "tokens:3"])


def test_generate_controls_flags_make_the_request(tmp_path, capsys):
    schema = tmp_path / "schema.json"
    schema.write_text('{"type": "object", "properties": {"a": {"type": "integer"}}}')
    flags = ["generate", "--text", "a", "--max-tokens", "5", "--min-p", "0.1", "--repetition-penalty", "1.3"]
    flags += ["--frequency-penalty", "0.5", "--presence-penalty", "-0.5", "--logit-bias", "3:-100,7:2.5"]
    flags += ["--stop", "a, b", "--stop", "\n", "--min-tokens", "2", "--n", "2", "--logprobs"]
    flags += ["--top-logprobs", "3", "--json-schema", str(schema), "--json"]
    request = build_generate_request(commands._request_options(parse(flags)))
    sampling = request.sampling
    assert (sampling.min_p, sampling.frequency_penalty, sampling.presence_penalty) == (
        pytest.approx(0.1),
        0.5,
        -0.5,
    )
    assert sampling.repetition_penalty == pytest.approx(1.3)
    assert dict(sampling.logit_bias) == {3: -100.0, 7: 2.5}
    assert (list(request.stop), request.min_tokens, request.n) == (["a, b", "\n"], 2, 2)
    assert (request.logprobs, request.top_logprobs) == (True, 3)
    assert json.loads(request.response_format.json_schema.schema)["properties"] == {"a": {"type": "integer"}}
    json_object = parse(["generate", "--text", "a", "--max-tokens", "5", "--json-object"])
    assert build_generate_request(commands._request_options(json_object)).response_format.json_object
    assert "give --json" in usage_error(capsys, ["generate", "--text", "a", "--max-tokens", "5", "--n", "2"])
    assert "ID:BIAS" in usage_error(
        capsys, ["generate", "--text", "a", "--max-tokens", "5", "--logit-bias", "x"]
    )
