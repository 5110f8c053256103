"""What the gateway answers, in OpenAI's shapes: completions, stream chunks, usage and deltaserve's
extension object. Pure: dicts from the planner's responses, no I/O."""

from __future__ import annotations

import codecs
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from gateway_svc.reasoning import ThoughtStream, split_thought
from gateway_svc.tool_calls import ToolCallStream, ToolSpec
from planner_svc.client import FINISH_REASONS
from protos import client_pb2
from protos.wire import unpack_i32

Kind = Literal["chat", "text"]
EXTENSION = "deltaserve"  # the key of the extension object in a response or a chunk
DONE = b"data: [DONE]\n\n"
_encode = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode  # one encoder, made once
_encode_str: Any = json.encoder.encode_basestring  # a JSON string literal, as _encode writes one (C)


@dataclass(slots=True)
class ChoiceState:
    """One choice as its responses arrive: the text and tokens so far, and its last response."""

    index: int
    prompt: int
    token_ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    prompt_tokens: int = 0
    last: client_pb2.GenerateResponse | None = None  # the one with the finish reason
    logprobs: list[client_pb2.TokenLogprobs] = field(default_factory=list)  # one per token, when asked
    # A completion's text_offset: the characters the tokens' bytes made so far (a token that ends inside a
    # character adds nothing; the next begins at that character), the same streamed or whole.
    offset_chars: int = 0
    offset_decoder: codecs.IncrementalDecoder = field(
        default_factory=lambda: codecs.getincrementaldecoder("utf-8")(errors="replace")
    )
    tool_spec: ToolSpec | None = None  # the tools it may call, and whether it must
    streamed: bool = False  # its text goes out as it comes (the streams below hold back what may be a tag)
    reasoning_field: str | None = None  # the field its thought goes in, apart from its content (None: none)
    include_reasoning: bool = True  # the thought goes out in that field (false: it is dropped)
    begins_in_thought: bool = False  # its text begins inside a thought its prompt opened (its first response)
    call_stream: ToolCallStream | None = field(default=None, init=False)  # streamed: its text, held for calls
    thought_stream: ThoughtStream | None = field(default=None, init=False)  # streamed, with reasoning
    calls: list[dict[str, Any]] = field(default_factory=list)  # the calls it made, found at its end

    def __post_init__(self) -> None:
        if self.streamed and self.tool_spec is not None:
            self.call_stream = ToolCallStream(self.tool_spec)

    def text_offsets(self, entries: Sequence[client_pb2.TokenLogprobs]) -> list[int]:
        """The text_offset of each of these tokens, the choice's next ones."""
        offsets = []
        for entry in entries:
            offsets.append(self.offset_chars)
            self.offset_chars += len(self.offset_decoder.decode(entry.chosen.token_bytes))
        return offsets

    def add(self, response: client_pb2.GenerateResponse) -> list[int]:
        """Takes one response in; returns its token ids."""
        ids = unpack_i32(response.token_ids).tolist()
        if not self.text:  # its first response
            self.begins_in_thought = response.begins_in_thought
            if self.streamed and self.reasoning_field is not None:
                self.thought_stream = ThoughtStream(response.begins_in_thought)
        self.token_ids.extend(ids)
        self.text.append(response.text)
        self.logprobs.extend(response.logprobs)
        self.prompt_tokens = response.prompt_tokens or self.prompt_tokens
        if response.finish_reason != client_pb2.FINISH_REASON_UNSPECIFIED:
            self.last = response
        return ids

    @property
    def finish_reason(self) -> str | None:
        """The planner's reason, or tool_calls where the choice made calls and ended as the model chose (a
        forced call cut by max_tokens keeps its `length`, one cut by a stop string its `stop`)."""
        if self.last is None:
            return None
        reason = FINISH_REASONS[self.last.finish_reason]
        return "tool_calls" if self.calls and reason == "stop" and not self.last.stop_string else reason

    def chat_message(self) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """The whole answer's chat message (its thought apart where asked; its text, or the calls it makes and
        the text before them), and the calls."""
        text = "".join(self.text)
        message: dict[str, Any] = {"role": "assistant"}
        if self.reasoning_field is not None:
            thought, text = split_thought(text, self.begins_in_thought)
            message[self.reasoning_field] = thought if self.include_reasoning else None
        parsed = self.tool_spec.find(text) if self.tool_spec is not None else None
        if parsed is None:
            message["content"] = text
            return message, []
        content, calls = parsed
        message.update(content=content if content.strip() else None, tool_calls=calls)
        return message, calls

    def streamed_text(self, response: client_pb2.GenerateResponse) -> tuple[str, str]:
        """The (thought, content) of a streamed response to send now: less what may begin a tag or a call, and
        at the choice's last response everything still held (its calls found)."""
        thought, text = "", response.text
        last = self.last is response
        if self.thought_stream is not None:
            thought, text = self.thought_stream.feed(text)
            if last:
                held_thought, held_text = self.thought_stream.finish()
                thought, text = thought + held_thought, text + held_text
        if self.call_stream is not None:
            text = self.call_stream.feed(text)
            if last:
                rest, self.calls = self.call_stream.finish()
                text += rest
        return (thought if self.include_reasoning else ""), text

    @property
    def stop_reason(self) -> str | None:
        """The stop string that ended the choice (vLLM's stop_reason), if one did."""
        return (self.last.stop_string or None) if self.last is not None else None


def _alternative(entry: client_pb2.TokenLogprob) -> dict[str, Any]:
    return {"token": entry.token, "logprob": entry.logprob, "bytes": list(entry.token_bytes)}


def logprobs(kind: Kind, entries: Sequence[client_pb2.TokenLogprobs], state: ChoiceState) -> dict[str, Any]:
    """OpenAI's logprobs object of a choice's next tokens: chat's `content` list, or a completion's parallel
    lists."""
    if kind == "chat":
        content = [
            {**_alternative(e.chosen), "top_logprobs": [_alternative(t) for t in e.top]} for e in entries
        ]
        return {"content": content}
    offsets = state.text_offsets(entries)
    return {
        "tokens": [e.chosen.token for e in entries],
        "token_logprobs": [e.chosen.logprob for e in entries],
        "top_logprobs": [{t.token: t.logprob for t in e.top} for e in entries],
        "text_offset": offsets,
    }


def extension(state: ChoiceState, conversation: str) -> dict[str, Any]:
    """deltaserve's extension object: what the request reused, where its history diverged, and its seed."""
    last = state.last
    assert last is not None
    return {
        "request_id": last.request_id,
        "conversation_id": conversation or None,
        "checkpoint": last.checkpoint,  # none | prefix | checkpoint@N | snapshot@N, with why it fell back
        "diverged_at": last.diverged_at,  # where the prompt first differed from the stored history; -1: nowhere
        "reused_tokens": last.reused_tokens,
        "read_tokens": last.read_tokens,
        # the planner's request's seed, drawn where the body had none: sent back as `seed`, it repeats the answer
        "seed": last.seed if last.HasField("seed") else None,
        # with shared_prefix: the tokens the conversation keeps pinned after the turn (0: none), and why not
        # the ones asked for where they differ
        **(
            {"pinned_prefix": last.pinned_prefix, "pin_note": last.pin_note or None}
            if last.HasField("pinned_prefix")
            else {}
        ),
    }


def usage(states: list[ChoiceState]) -> dict[str, Any]:
    """Prompt tokens counted once per prompt (its first choice's), completion tokens of every choice; the
    cached tokens are the prompt tokens whose KV was reused (a checkpoint, a snapshot, shared pages)."""
    firsts: dict[int, ChoiceState] = {}
    for state in states:
        firsts.setdefault(state.prompt, state)
    prompt = sum(s.prompt_tokens for s in firsts.values())
    cached = sum(s.last.reused_tokens for s in firsts.values() if s.last is not None)
    completion = sum(len(s.token_ids) for s in states)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def _header(kind: Kind, response_id: str, created: int, model: str, chunk: bool) -> dict[str, Any]:
    if kind == "chat":
        name = "chat.completion.chunk" if chunk else "chat.completion"
    else:
        name = "text_completion"
    return {"id": response_id, "object": name, "created": created, "model": model}


def completion(
    kind: Kind,
    response_id: str,
    created: int,
    model: str,
    states: list[ChoiceState],
    conversation: str,
    token_ids: bool,
    with_logprobs: bool,
) -> dict[str, Any]:
    """The whole (non-streamed) answer."""
    choices = []
    for state in sorted(states, key=lambda s: s.index):
        answer: dict[str, Any] | str = "".join(state.text)
        if kind == "chat":
            answer, state.calls = state.chat_message()  # before the finish reason, which the calls change
        choice: dict[str, Any] = {
            "index": state.index,
            "finish_reason": state.finish_reason,
            "stop_reason": state.stop_reason,
            "logprobs": logprobs(kind, state.logprobs, state) if with_logprobs else None,
        }
        choice["message" if kind == "chat" else "text"] = answer
        if token_ids:
            choice["token_ids"] = state.token_ids
        choices.append(choice)
    reply = _header(kind, response_id, created, model, chunk=False)
    reply.update(choices=choices, usage=usage(states))
    reply[EXTENSION] = extension(min(states, key=lambda s: s.index), conversation)
    return reply


@dataclass(slots=True)
class ChunkWriter:
    """The server-sent events of one streamed answer."""

    kind: Kind
    response_id: str
    created: int
    model: str
    conversation: str
    token_ids: bool  # each delta carries its token ids
    include_usage: bool
    with_logprobs: bool  # each delta carries its tokens' logprobs
    _started: set[int] = field(default_factory=set)  # choices whose first chunk went out
    _head: bytes = b""  # a plain chunk's bytes before its choice (the same for every chunk of the answer)
    _tail: bytes = b""

    def __post_init__(self) -> None:
        # A chunk is written for every token of every stream: only its choice is encoded each time.
        plain = _header(self.kind, self.response_id, self.created, self.model, chunk=True)
        plain["choices"] = ["@"]
        if self.include_usage:
            plain["usage"] = None
        head, tail = _encode(plain).split('"@"')
        self._head, self._tail = b"data: " + head.encode(), tail.encode() + b"\n\n"

    def event(self, payload: dict[str, Any]) -> bytes:
        return b"data: " + _encode(payload).encode() + b"\n\n"

    def chunk(
        self, state: ChoiceState, response: client_pb2.GenerateResponse, ids: list[int]
    ) -> bytes | None:
        """The event of one planner response of a choice (None when it carries nothing to send yet: text
        held back until a character is whole, or while it may begin a call of a tool)."""
        assert state.streamed, "a choice written as a stream holds its text back in its streams"
        thought, text = state.streamed_text(response)
        finish = state.finish_reason if state.last is response else None
        first = state.index not in self._started
        if not (text or thought or finish or first or ((self.token_ids or self.with_logprobs) and ids)):
            return None
        if not (first or finish or self.with_logprobs):  # most events: their bytes written directly
            return self._head + self._plain_choice(state, text, thought, ids).encode() + self._tail
        self._started.add(state.index)
        choice: dict[str, Any] = {"index": state.index, "finish_reason": finish, "logprobs": None}
        if self.with_logprobs:
            choice["logprobs"] = logprobs(self.kind, response.logprobs, state)
        if finish is not None:
            choice["stop_reason"] = state.stop_reason
        if self.kind == "chat":
            delta: dict[str, Any] = {"role": "assistant"} if first else {}
            if thought:
                assert state.reasoning_field is not None  # a thought is split only where it has a field
                delta[state.reasoning_field] = thought
            if text or (first and not thought):
                delta["content"] = text
            if finish is not None and state.calls:
                delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(state.calls)]
            choice["delta"] = delta
        else:
            choice["text"] = text
        if self.token_ids:
            choice["token_ids"] = ids
        if finish is None:
            return self._head + _encode(choice).encode() + self._tail
        payload = _header(self.kind, self.response_id, self.created, self.model, chunk=True)
        payload["choices"] = [choice]
        if self.include_usage:
            payload["usage"] = None
        payload[EXTENSION] = extension(state, self.conversation)
        return self.event(payload)

    def _plain_choice(self, state: ChoiceState, text: str, thought: str, ids: list[int]) -> str:
        """The choice of a chunk neither first nor last nor with logprobs, as _encode would write its dict
        (a third of the time of building and encoding it)."""
        index = state.index
        if self.kind == "chat":
            fields = [f'"{state.reasoning_field}":{_encode_str(thought)}'] if thought else []
            if text:
                fields.append(f'"content":{_encode_str(text)}')
            body = f'"delta":{{{",".join(fields)}}}'
        else:
            body = f'"text":{_encode_str(text)}'
        if self.token_ids:
            body += f',"token_ids":[{",".join(map(str, ids))}]'
        return f'{{"index":{index},"finish_reason":null,"logprobs":null,{body}}}'

    def usage_chunk(self, states: list[ChoiceState]) -> bytes:
        """The last chunk when stream_options.include_usage: no choices, the usage of the whole answer."""
        payload = _header(self.kind, self.response_id, self.created, self.model, chunk=True)
        payload.update(choices=[], usage=usage(states))
        return self.event(payload)

    def error(self, body: dict[str, Any]) -> bytes:
        """An error after the stream began (its HTTP status was already sent): an event with the error
        object, as OpenAI's SDKs read it."""
        return self.event(body)
