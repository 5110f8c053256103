"""Async client of the planner's API (deltaserve.v1.Planner)."""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from planner_svc.chat_wire import chat_messages
from protos import client_pb2, client_pb2_grpc
from protos.rpc import ChannelSecurity, open_channel, wait_serving
from protos.wire import pack_i32, unpack_i32

FINISH_REASONS = {
    client_pb2.FINISH_REASON_STOP: "stop",
    client_pb2.FINISH_REASON_LENGTH: "length",
    client_pb2.FINISH_REASON_ABORT: "abort",
}


@dataclass(slots=True)
class Generation:
    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str  # stop | length | abort
    prompt_tokens: int
    reused_tokens: int  # prompt tokens whose KV was reused (a conversation's checkpoint, shared pages)
    read_tokens: int  # prompt tokens read (prefilled)
    checkpoint: str  # what was mounted: none | prefix | checkpoint@N | snapshot@N, with why it fell back
    diverged_at: int  # where the prompt first differed from the conversation's stored tokens; -1: nowhere
    index: int = 0  # the choice (0 to n - 1)
    stop_string: str = ""  # the stop string that ended it, if one did
    seed: int | None = None  # the request's seed (the planner's drawn one where unset): sent back, it repeats
    # with shared_prefix: the tokens its conversation keeps pinned after the turn (0: none), and why not the
    # ones asked for where they differ; None: no shared prefix was asked
    pinned_prefix: int | None = None
    pin_note: str = ""
    logprobs: list[client_pb2.TokenLogprobs] = field(default_factory=list)  # one per token, with logprobs


@dataclass(slots=True)
class Parked:
    bytes: int  # 0: nothing was in the pool (already parked, or no turn finished yet)
    tokens: int


@dataclass(slots=True)
class Resumed:
    tokens: int
    checkpoints: list[int]


@dataclass(slots=True)
class Deleted:
    tokens: int  # what the planner held of it (0 where it held none: only the cache did, or its KV was lost)
    pages: int  # KV pages freed (not those another conversation or request still shares)
    snapshot_bytes: int  # of its snapshot deleted from the cache service; 0: it had none


@dataclass(slots=True)
class ConversationInfo:
    conversation_id: str
    tokens: int
    checkpoints: list[int]
    parked: bool  # its pages live in the cache service
    pages: int  # KV pages it holds in the pool
    pinned_prefix: int  # tokens of its pinned shared prefix; 0: none


def _response_format(response_format: Mapping[str, Any]) -> client_pb2.ResponseFormat:
    """OpenAI's shape: {"type": "json_object"} | {"type": "json_schema", "json_schema": {"name": ...,
    "schema": {...} or JSON text, "strict": true}} | {"type": "text"} (no constraint)."""
    kind = response_format.get("type") if isinstance(response_format, Mapping) else None
    if kind == "text":
        return client_pb2.ResponseFormat()
    if kind == "json_object":
        return client_pb2.ResponseFormat(json_object=True)
    spec = response_format.get("json_schema") if kind == "json_schema" else None
    if isinstance(spec, Mapping) and "schema" in spec:
        schema = spec["schema"]
        return client_pb2.ResponseFormat(
            json_schema=client_pb2.ResponseFormat.JsonSchema(
                name=str(spec.get("name", "")),
                schema=schema if isinstance(schema, str) else json.dumps(schema),
                strict=bool(spec.get("strict", True)),
            )
        )
    raise ValueError(
        'response_format must be {"type": "text"}, {"type": "json_object"} or {"type": "json_schema", '
        f'"json_schema": {{"schema": ...}}}}, got {response_format!r}'
    )


def _shared_prefix(prefix: Mapping[str, int]) -> client_pb2.SharedPrefix:
    """{"messages": K} | {"message": I, "chars": N} | {"tokens": N} -> the SharedPrefix message."""
    integers = isinstance(prefix, Mapping) and all(
        isinstance(value, int) and not isinstance(value, bool) for value in prefix.values()
    )
    keys = set(prefix) if integers else None
    if keys == {"messages"}:
        return client_pb2.SharedPrefix(messages=prefix["messages"])
    if keys == {"tokens"}:
        return client_pb2.SharedPrefix(tokens=prefix["tokens"])
    if keys == {"message", "chars"}:
        return client_pb2.SharedPrefix(
            message=client_pb2.SharedPrefix.MessageChars(message=prefix["message"], chars=prefix["chars"])
        )
    raise ValueError(
        'shared_prefix must be {"messages": K}, {"message": I, "chars": N} or {"tokens": N} with integer '
        f"values, got {prefix!r}"
    )


@dataclass(slots=True, kw_only=True)
class GenerateOptions:
    """One request: exactly one of text, chat or token_ids, what to sample, and where it belongs.

    With a conversation_id the prompt carries the whole history and the planner resumes from the
    conversation's longest retained checkpoint that is a prefix of it; tenant "" is the default one.
    shared_prefix (a conversation's pinned read-only start: {"messages": K}, {"message": I, "chars": N}
    or {"tokens": N}) needs a conversation_id. The planner checks the values (INVALID_ARGUMENT).
    """

    max_tokens: int  # 0: as many as fit in the context after the prompt
    text: str | None = None
    # Messages: role and content, and an assistant's tool_calls (OpenAI's list) or a tool's tool_call_id
    chat: Sequence[Mapping[str, Any]] | None = None
    # More variables for the chat template, such as {"enable_thinking": False} for Qwen3's (needs a chat)
    chat_template_kwargs: Mapping[str, Any] | None = None
    tools: Sequence[Mapping[str, Any]] | None = None  # OpenAI's function tools, for the chat template
    token_ids: Sequence[int] | None = None
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None  # None: the planner draws one (unseeded requests differ); 0 is a seed
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: Mapping[int, float] | None = None  # token id -> bias in [-100, 100]
    stop: Sequence[str] = ()  # stop strings, at most 4
    stop_token_ids: Iterable[int] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    n: int = 1  # choices from the one prompt
    logprobs: bool = False
    top_logprobs: int = 0  # 0-20 alternatives a token (needs logprobs)
    response_format: Mapping[str, Any] | None = None  # OpenAI's shape (see _response_format)
    request_id: str = ""
    conversation_id: str = ""
    tenant: str = ""
    shared_prefix: Mapping[str, int] | None = None


def build_generate_request(options: GenerateOptions) -> client_pb2.GenerateRequest:
    """The GenerateRequest of `options`; ValueError unless exactly one of text, chat or token_ids is given,
    for a malformed chat message or shared prefix, for a shared prefix without a conversation and for chat
    template kwargs or tools without a chat."""
    o = options
    given = [
        name
        for name, value in (("text", o.text), ("chat", o.chat), ("token_ids", o.token_ids))
        if value is not None
    ]
    if len(given) != 1:
        raise ValueError(f"give exactly one of text, chat or token_ids (got {', '.join(given) or 'none'})")
    if (o.chat_template_kwargs or o.tools) and o.chat is None:
        raise ValueError("chat_template_kwargs and tools are given to the chat template: give a chat")
    request = client_pb2.GenerateRequest(
        request_id=o.request_id,
        sampling=client_pb2.SamplingParams(
            temperature=o.temperature,
            top_p=o.top_p,
            top_k=o.top_k,
            seed=o.seed,
            min_p=o.min_p,
            repetition_penalty=o.repetition_penalty,
            frequency_penalty=o.frequency_penalty,
            presence_penalty=o.presence_penalty,
            logit_bias=dict(o.logit_bias or {}),
        ),
        max_tokens=o.max_tokens,
        stop=list(o.stop),
        stop_token_ids=list(o.stop_token_ids),
        ignore_eos=o.ignore_eos,
        min_tokens=o.min_tokens,
        n=o.n,
        logprobs=o.logprobs,
        top_logprobs=o.top_logprobs,
        conversation_id=o.conversation_id,
        tenant=o.tenant,
    )
    if o.response_format is not None:
        request.response_format.CopyFrom(_response_format(o.response_format))
    if o.shared_prefix is not None:
        if not o.conversation_id:
            raise ValueError("shared_prefix marks a conversation's prefix: give a conversation_id too")
        request.shared_prefix.CopyFrom(_shared_prefix(o.shared_prefix))
    if o.text is not None:
        request.text = o.text
    elif o.chat is not None:
        request.chat.CopyFrom(chat_messages(o.chat, o.chat_template_kwargs, o.tools))
    else:
        request.token_ids = pack_i32(o.token_ids)
    return request


def _keyed(key: str | None) -> tuple[tuple[str, str], ...] | None:
    """A call's own `authorization` metadata (a gateway forwards each caller's key), or none."""
    return (("authorization", f"Bearer {key}"),) if key else None


class PlannerClient:
    """One channel to a planner; use as `async with PlannerClient("host:port") as client:`.

    `security`: TLS (the CA to trust, a client certificate) and the API key sent with every call. A call's
    `key` sends that key with it alone (the HTTP gateway forwards each caller's bearer key so)."""

    def __init__(self, addr: str, security: ChannelSecurity | None = None) -> None:
        self.addr = addr
        self._channel = open_channel(addr, security)
        self._stub = client_pb2_grpc.PlannerStub(self._channel)

    async def __aenter__(self) -> PlannerClient:
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    def connected(self) -> bool:
        """Whether the channel holds a live connection (not after a failed connect: nothing answered)."""
        return self._channel.get_state() == grpc.ChannelConnectivity.READY

    async def wait_ready(self, timeout: float) -> None:
        """Returns once the planner's health service says SERVING; TimeoutError otherwise."""
        await wait_serving(self._channel, timeout)

    async def serving(self, timeout: float = 2.0) -> bool:
        """Whether the planner's health service says SERVING now (False when it does not answer)."""
        try:
            reply = await health_pb2_grpc.HealthStub(self._channel).Check(
                health_pb2.HealthCheckRequest(), timeout=timeout
            )
        except grpc.aio.AioRpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    async def generate(
        self, options: GenerateOptions, key: str | None = None
    ) -> AsyncGenerator[client_pb2.GenerateResponse, None]:
        """Streams the GenerateResponses of one request. The last response carries the finish reason, the
        seed and what was reused (reused_tokens, read_tokens, checkpoint, diverged_at); a conversation's turn
        that asked for a shared prefix, the prefix pinned after it (pinned_prefix, pin_note).

        Leaving the loop early cancels the call, which the planner treats as an abort.
        """
        request = build_generate_request(options)
        call = self._stub.Generate(request, metadata=_keyed(key))
        try:
            async for response in call:
                yield response
        finally:
            call.cancel()

    async def generate_all(self, options: GenerateOptions, key: str | None = None) -> Generation:
        """Runs one request of one choice to its end and gathers what it streamed."""
        if options.n > 1:
            raise ValueError(f"n is {options.n}: gather several choices with generate_choices")
        return (await self.generate_choices(options, key))[0]

    async def generate_choices(self, options: GenerateOptions, key: str | None = None) -> list[Generation]:
        """Runs one request to its end and gathers what each of its choices streamed, by index."""
        request_id = ""
        token_ids: dict[int, list[int]] = {}
        text_parts: dict[int, list[str]] = {}
        logprobs: dict[int, list[client_pb2.TokenLogprobs]] = {}
        last: dict[int, client_pb2.GenerateResponse] = {}
        async for response in self.generate(options, key):
            request_id = request_id or response.request_id
            index = response.index
            token_ids.setdefault(index, []).extend(unpack_i32(response.token_ids).tolist())
            text_parts.setdefault(index, []).append(response.text)
            logprobs.setdefault(index, []).extend(response.logprobs)
            if response.finish_reason != client_pb2.FINISH_REASON_UNSPECIFIED:
                last[index] = response
        choices = max(options.n, 1)
        if sorted(last) != list(range(choices)):
            raise RuntimeError(
                f"request {request_id!r}: the stream ended with {len(last)} of {choices} choices finished"
            )
        return [
            Generation(
                request_id=request_id,
                token_ids=token_ids[index],
                text="".join(text_parts[index]),
                finish_reason=FINISH_REASONS[end.finish_reason],
                prompt_tokens=end.prompt_tokens,
                reused_tokens=end.reused_tokens,
                read_tokens=end.read_tokens,
                checkpoint=end.checkpoint,
                diverged_at=end.diverged_at,
                index=index,
                stop_string=end.stop_string,
                seed=end.seed if end.HasField("seed") else None,  # None: a planner from before the field
                pinned_prefix=end.pinned_prefix if end.HasField("pinned_prefix") else None,
                pin_note=end.pin_note,
                logprobs=logprobs[index],
            )
            for index, end in sorted(last.items())
        ]

    async def park(self, conversation_id: str, tenant: str = "") -> Parked:
        """Moves an idle conversation's KV pages into the cache service (NOT_FOUND when unknown,
        FAILED_PRECONDITION while a turn runs on it, the cache's status when it cannot store them)."""
        reply = await self._stub.Park(client_pb2.ParkRequest(conversation_id=conversation_id, tenant=tenant))
        return Parked(bytes=reply.bytes, tokens=reply.tokens)

    async def resume(self, conversation_id: str, tenant: str = "") -> Resumed:
        """Restores a parked conversation's pages into the pool (the next generate on it does this too);
        NOT_FOUND when there is nothing to restore, FAILED_PRECONDITION while a turn runs on it, DATA_LOSS for a
        snapshot that failed its checksum."""
        reply = await self._stub.Resume(
            client_pb2.ResumeRequest(conversation_id=conversation_id, tenant=tenant)
        )
        return Resumed(tokens=reply.tokens, checkpoints=list(reply.checkpoints))

    async def delete_conversation(
        self, conversation_id: str, tenant: str = "", key: str | None = None
    ) -> Deleted:
        """Forgets the conversation: its pages and checkpoints in the planner, its snapshot in the cache service.
        NOT_FOUND where neither holds it, FAILED_PRECONDITION while a turn streams on it (abort it first), the
        cache's status (UNAVAILABLE, ...) when it cannot be asked (nothing is deleted then)."""
        reply = await self._stub.DeleteConversation(
            client_pb2.DeleteConversationRequest(conversation_id=conversation_id, tenant=tenant),
            metadata=_keyed(key),
        )
        return Deleted(tokens=reply.tokens, pages=reply.pages, snapshot_bytes=reply.snapshot_bytes)

    async def conversations(self, tenant: str = "") -> list[ConversationInfo]:
        """The tenant's conversations the planner knows of (since it started), parked ones included."""
        reply = await self._stub.ListConversations(client_pb2.ListConversationsRequest(tenant=tenant))
        return [
            ConversationInfo(
                conversation_id=c.conversation_id,
                tokens=c.tokens,
                checkpoints=list(c.checkpoints),
                parked=c.parked,
                pages=c.pages,
                pinned_prefix=c.pinned_prefix,
            )
            for c in reply.conversations
        ]

    async def abort(self, request_id: str, tenant: str = "", key: str | None = None) -> bool:
        """True when the tenant's running or waiting request was aborted; False when unknown or already
        finished (ids are per tenant: `tenant` as for park, for the service identity or an open API)."""
        reply = await self._stub.Abort(
            client_pb2.AbortRequest(request_id=request_id, tenant=tenant), metadata=_keyed(key)
        )
        return reply.aborted

    async def model_info(self, key: str | None = None) -> client_pb2.ModelInfo:
        return await self._stub.GetModelInfo(client_pb2.ModelInfoRequest(), metadata=_keyed(key))

    async def server_info(self) -> client_pb2.ServerInfo:
        return await self._stub.GetServerInfo(client_pb2.ServerInfoRequest())
