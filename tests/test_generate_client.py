"""The client's GenerateRequest (one prompt, the seed left for the planner to draw, the conversation and its
shared prefix) and `deltaserve generate` end to end: streamed and as JSON against the real stack, and a
plain error when no planner listens."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest

from planner_svc.client import GenerateOptions, PlannerClient, build_generate_request
from protos.wire import unpack_i32
from tests.cli_helpers import REPO, cli_env, free_port

# ---- client ----


def test_generate_request_takes_exactly_one_prompt():
    request = build_generate_request(
        GenerateOptions(token_ids=[5, 6], max_tokens=3, temperature=0.5, stop_token_ids=(2,))
    )
    assert request.WhichOneof("prompt") == "token_ids"
    assert unpack_i32(request.token_ids).tolist() == [5, 6]
    assert (request.max_tokens, request.sampling.temperature, list(request.stop_token_ids)) == (3, 0.5, [2])
    chat = build_generate_request(GenerateOptions(chat=[{"role": "user", "content": "hi"}], max_tokens=1))
    assert (chat.chat.messages[0].role, chat.chat.messages[0].content) == ("user", "hi")
    with pytest.raises(ValueError, match="exactly one"):
        build_generate_request(GenerateOptions(text="a", token_ids=[1], max_tokens=1))
    with pytest.raises(ValueError, match="exactly one"):
        build_generate_request(GenerateOptions(max_tokens=1))
    with pytest.raises(ValueError, match="role"):
        build_generate_request(GenerateOptions(chat=[{"text": "hi"}], max_tokens=1))


def test_chat_template_kwargs_travel_as_json_with_a_chat_only():
    chat = [{"role": "user", "content": "hi"}]
    request = build_generate_request(
        GenerateOptions(chat=chat, max_tokens=1, chat_template_kwargs={"enable_thinking": False, "n": 3})
    )
    assert json.loads(request.chat.template_kwargs) == {"enable_thinking": False, "n": 3}
    assert build_generate_request(GenerateOptions(chat=chat, max_tokens=1)).chat.template_kwargs == ""
    with pytest.raises(ValueError, match="give a chat"):
        build_generate_request(GenerateOptions(text="a", max_tokens=1, chat_template_kwargs={"x": 1}))
    with pytest.raises(ValueError, match="must be JSON values"):
        build_generate_request(GenerateOptions(chat=chat, max_tokens=1, chat_template_kwargs={"x": {1, 2}}))


def test_an_unseeded_request_leaves_the_seed_unset_for_the_planner_to_draw():
    unseeded = build_generate_request(GenerateOptions(text="a", max_tokens=1, temperature=1.0))
    assert not unseeded.sampling.HasField("seed")
    zero = build_generate_request(GenerateOptions(text="a", max_tokens=1, temperature=1.0, seed=0))
    assert zero.sampling.HasField("seed") and zero.sampling.seed == 0  # 0 is a seed, sent as one


def test_generate_request_carries_the_conversation_and_its_shared_prefix():
    chat = [{"role": "system", "content": "doc"}, {"role": "user", "content": "q"}]
    request = build_generate_request(
        GenerateOptions(
            chat=chat, max_tokens=1, conversation_id="c1", tenant="t", shared_prefix={"messages": 1}
        )
    )
    assert (request.conversation_id, request.tenant, request.shared_prefix.messages) == ("c1", "t", 1)
    by_chars = build_generate_request(
        GenerateOptions(
            chat=chat, max_tokens=1, conversation_id="c1", shared_prefix={"message": 1, "chars": 0}
        )
    )
    assert by_chars.shared_prefix.WhichOneof("prefix") == "message"
    assert (by_chars.shared_prefix.message.message, by_chars.shared_prefix.message.chars) == (1, 0)
    by_tokens = build_generate_request(
        GenerateOptions(token_ids=[1, 2], max_tokens=1, conversation_id="c", shared_prefix={"tokens": 1})
    )
    assert by_tokens.shared_prefix.tokens == 1
    assert not build_generate_request(GenerateOptions(text="a", max_tokens=1)).HasField("shared_prefix")
    for bad in ({"messages": 1, "tokens": 2}, {"message": 1}, {"tokens": "3"}, {"tokens": True}, {}):
        with pytest.raises(ValueError, match="shared_prefix must be"):
            build_generate_request(
                GenerateOptions(text="a", max_tokens=1, conversation_id="c", shared_prefix=bad)
            )
    with pytest.raises(ValueError, match="conversation_id"):
        build_generate_request(GenerateOptions(text="a", max_tokens=1, shared_prefix={"tokens": 1}))


def test_generate_says_plainly_when_the_planner_is_not_reachable():
    addr = f"127.0.0.1:{free_port()}"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "deltaserve",
            "generate",
            "--addr",
            addr,
            "--text",
            "hi",
            "--max-tokens",
            "2",
        ],
        capture_output=True,
        text=True,
        env=cli_env(),
        cwd=REPO,
        timeout=60,
    )
    assert done.returncode == 1
    assert f"error: cannot reach the planner at {addr}" in done.stderr
    assert done.stdout == ""


# ---- end to end, against the real stack ----


@pytest.mark.asyncio(loop_scope="session")
async def test_generate_command_streams_and_prints_json_like_the_client(smol_stack):
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    async with PlannerClient(smol_stack.addr) as client:
        expected = await client.generate_all(GenerateOptions(chat=chat, max_tokens=12))

    async def deltaserve_generate(*flags: str) -> str:
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "deltaserve",
            "--log-level",
            "warning",
            "generate",
            "--addr",
            smol_stack.addr,
            "--chat-json",
            "-",
            "--max-tokens",
            "12",
            *flags,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=cli_env(),
            cwd=REPO,
        )
        out, err = await asyncio.wait_for(process.communicate(json.dumps(chat).encode()), timeout=120)
        assert process.returncode == 0, err.decode()
        return out.decode()

    printed = json.loads(await deltaserve_generate("--json", "--request-id", "cli-json"))
    reuse = {key: printed.pop(key) for key in ("reused_tokens", "read_tokens", "checkpoint", "diverged_at")}
    assert isinstance(printed.pop("seed"), int)  # no --seed: the one the planner drew
    assert printed == {
        "request_id": "cli-json",
        "token_ids": expected.token_ids,
        "text": expected.text,
        "finish_reason": expected.finish_reason,
        "prompt_tokens": expected.prompt_tokens,
        "index": 0,
        "stop_string": "",
    }
    # No conversation: only pages shared with an identical earlier prompt can have been reused.
    assert reuse["reused_tokens"] + reuse["read_tokens"] == expected.prompt_tokens
    assert reuse["checkpoint"] in ("none", "prefix") and reuse["diverged_at"] == -1
    assert await deltaserve_generate() == expected.text + "\n"
