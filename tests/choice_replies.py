"""One chat choice's pieces of text answered both ways, whole and streamed (ChunkWriter's events), for the tests
that check the two agree: tool calls and thoughts."""

from __future__ import annotations

import json
from typing import Any, NamedTuple

from gateway_svc.openai_replies import ChoiceState, ChunkWriter, completion
from gateway_svc.tool_calls import ToolSpec
from protos import client_pb2
from protos.wire import pack_i32


class Both(NamedTuple):
    answer: dict[str, Any]  # the whole answer's choice
    content: str  # the stream's content deltas joined
    thought: str  # its deltas' thought (in reasoning_field) joined
    calls: list[dict[str, Any]]  # its tool_calls
    finish: str  # its finish reason


def both(
    pieces: list[str],
    finish: int,
    stop_string: str = "",
    *,
    spec: ToolSpec | None = None,
    reasoning_field: str | None = None,
    include_reasoning: bool = True,
    begins_in_thought: bool = False,
) -> Both:
    """The whole answer and the stream of a choice whose responses carry `pieces` (the last with `finish`); token
    ids go out as they come, whatever is held."""
    writer = ChunkWriter(
        "chat", "chatcmpl-r", 1, "m", "", token_ids=True, include_usage=False, with_logprobs=False
    )
    streamed, whole = (
        ChoiceState(
            0,
            0,
            tool_spec=spec,
            streamed=stream,
            reasoning_field=reasoning_field,
            include_reasoning=include_reasoning,
        )
        for stream in (True, False)
    )
    responses = [
        client_pb2.GenerateResponse(text=piece, token_ids=pack_i32([i])) for i, piece in enumerate(pieces)
    ]
    responses[0].begins_in_thought = begins_in_thought
    responses[-1].finish_reason, responses[-1].stop_string = finish, stop_string
    deltas = []
    for response in responses:
        whole.add(response)
        deltas.append(json.loads(writer.chunk(streamed, response, streamed.add(response))[6:])["choices"][0])
    assert [d["token_ids"] for d in deltas] == [[i] for i in range(len(pieces))]
    [answer] = completion("chat", "chatcmpl-r", 1, "m", [whole], "", False, False)["choices"]
    return Both(
        answer,
        "".join(d["delta"].get("content") or "" for d in deltas),
        "".join(d["delta"].get(reasoning_field or "") or "" for d in deltas),
        [c for d in deltas for c in d["delta"].get("tool_calls", ())],
        deltas[-1]["finish_reason"],
    )
