"""A GenerateRequest made into a scheduler Request: every field checked (validation.py), then the prompt
tokenized and chat-templated on a small thread pool, off the event loop (the Rust tokenizer frees the GIL,
so other streams keep their steps while a long prompt is read)."""

from __future__ import annotations

import asyncio
import contextvars
import functools
import secrets
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import structlog

from planner_svc.chat_tools import parse_tool_calls, parse_tools
from planner_svc.conversations import common_prefix
from planner_svc.json_grammar import SchemaCompiler
from planner_svc.requests import Request, Sampling
from planner_svc.shared_prefix import resolve_shared_prefix
from planner_svc.template_kwargs import parse_template_kwargs
from planner_svc.tokenizer import (
    TemplateRefused,
    begins_in_thought,
    chat_ids,
    reserved_template_names,
    text_ids,
)
from planner_svc.validation import (
    GREEDY_BELOW,
    check_generate,
    check_length,
    check_min_tokens,
    limits_for,
    unset_max_tokens,
)
from protos import client_pb2, executor_pb2
from protos.wire import unpack_i32

log = structlog.get_logger("deltaserve.planner")

TOKENIZING_THREADS = 2
DRAWN_SEED_BITS = 53  # an unseeded request's seed: JavaScript's Number holds every integer below 2^53

Messages = list[dict[str, Any]]  # role, content, and an assistant's tool_calls or a tool's tool_call_id


def model_eos_ids(described: executor_pb2.ExecutorDescription, tokenizer_eos: int | None) -> tuple[int, ...]:
    """The ids that end a request: every one the executor names (from the model's own metadata: tokenizer
    versions differ on it), its single id where it predates the list, else the tokenizer's, else none."""
    if described.eos_token_ids:
        return tuple(described.eos_token_ids)
    if described.HasField("eos_token_id"):
        return (described.eos_token_id,)
    return () if tokenizer_eos is None else (tokenizer_eos,)


def _message(index: int, message: client_pb2.ChatMessage) -> dict[str, Any]:
    """A chat message as the chat template reads it."""
    fields: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.tool_calls:
        fields["tool_calls"] = parse_tool_calls(index, message.tool_calls)
    if message.tool_call_id:
        fields["tool_call_id"] = message.tool_call_id
    if message.reasoning:
        fields["reasoning_content"] = message.reasoning  # the name Qwen3's and Qwen3.5's templates read
    return fields


class Intake:
    def __init__(
        self,
        tokenizer,
        eos_token_ids: tuple[int, ...],
        vocab_size: int,
        max_seq_len: int,
        default_max_tokens: int = 0,
    ):
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.default_max_tokens = default_max_tokens  # for requests without max_tokens (0: all that fit)
        self.limits = limits_for(tokenizer, vocab_size, max_seq_len)
        self.schemas = SchemaCompiler(tokenizer, vocab_size)
        self._threads = ThreadPoolExecutor(max_workers=TOKENIZING_THREADS, thread_name_prefix="tokenize")

    @functools.cached_property
    def reserved(self) -> frozenset[str]:
        """The names a chat's template kwargs may not take (found at the first chat, not at start)."""
        return reserved_template_names(self.tokenizer)

    async def prepare(self, request: client_pb2.GenerateRequest, request_id: str) -> Request:
        """The request checked and its prompt tokenized; ValueError (INVALID_ARGUMENT) says what is wrong."""
        check_generate(request, self.limits)
        call = contextvars.copy_context().run  # the request id stays bound in the worker's log lines
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._threads, call, self._make_request, request, request_id)

    def _prompt(
        self, request: client_pb2.GenerateRequest
    ) -> tuple[list[int], Messages | None, dict[str, Any]]:
        """The prompt's ids, and its chat messages and template kwargs (its tools among them) when it came as a
        chat."""
        kind = request.WhichOneof("prompt")
        if kind == "text":
            return (text_ids(self.tokenizer, request.text) if request.text else []), None, {}
        if kind == "chat":
            messages = [_message(index, m) for index, m in enumerate(request.chat.messages)]
            kwargs = parse_template_kwargs(request.chat.template_kwargs, self.reserved)
            tools = parse_tools(request.chat.tools)
            if tools is not None:  # apply_chat_template's own parameter, passed with the variables
                kwargs["tools"] = tools
            if not messages:
                return [], messages, kwargs
            return chat_ids(self.tokenizer, messages, kwargs), messages, kwargs
        if kind == "token_ids":
            return unpack_i32(request.token_ids).tolist(), None, {}
        return [], None, {}

    def _marks(
        self,
        request: client_pb2.GenerateRequest,
        req: Request,
        messages: Messages | None,
        kwargs: dict[str, Any],
    ) -> None:
        """The root (end of the system prompt) and the pinned shared prefix of a conversation's turn, found by
        rendering the first messages as the prompt's were (with the same template kwargs)."""
        render = functools.partial(
            chat_ids, self.tokenizer, template_kwargs=kwargs, add_generation_prompt=False
        )
        if messages and messages[0]["role"] == "system":
            try:
                req.root = common_prefix(render(messages[:1]), req.prompt_ids) or None
            except TemplateRefused:  # a template may refuse a system turn alone: then the turn has no root
                pass
        if request.HasField("shared_prefix"):
            prefix = request.shared_prefix
            kind = prefix.WhichOneof("prefix")
            value: int | tuple[int, int] = 0
            if kind == "message":
                value = (prefix.message.message, prefix.message.chars)
            elif kind:
                value = getattr(prefix, kind)
            try:
                tokens, why = resolve_shared_prefix(kind, value, req.prompt_ids, messages, render)
            except TemplateRefused as error:
                tokens, why = None, f"the shared prefix's messages alone do not render: {error}"
            if tokens is None:
                log.info("shared prefix not marked", reason=why)
                req.pin_note = f"the shared prefix was not marked: {why}"
            req.pinned, req.pin_asked = tokens, True

    def _grammar(self, request: client_pb2.GenerateRequest) -> str | None:
        """The request's response_format as a grammar ("" any JSON object, else the schema), checked."""
        kind = request.response_format.WhichOneof("format")
        if kind == "json_object":
            return ""
        if kind != "json_schema":
            return None
        schema = request.response_format.json_schema.schema
        error = self.schemas.error(schema)
        if error is not None:
            raise ValueError(f"response_format.json_schema.schema {error}")
        return schema

    def _make_request(self, request: client_pb2.GenerateRequest, request_id: str) -> Request:
        prompt_ids, messages, kwargs = self._prompt(request)
        if not prompt_ids:
            raise ValueError("the prompt is empty: give text, chat messages or token ids")
        max_tokens = request.max_tokens or unset_max_tokens(
            len(prompt_ids), self.limits.max_seq_len, self.default_max_tokens, request.min_tokens
        )
        check_length(len(prompt_ids), max_tokens, self.limits.max_seq_len)
        check_min_tokens(request.min_tokens, max_tokens)
        params = request.sampling
        sampling = Sampling(
            temperature=params.temperature if params.temperature >= GREEDY_BELOW else 0.0,
            top_p=params.top_p if params.HasField("top_p") else 1.0,
            top_k=params.top_k,
            # unset: a seed drawn here, so unseeded requests differ (n choices draw from it + i: choices.py);
            # 53 bits, so the seed reported back (GenerateResponse.seed) is exact as a JSON number too
            seed=params.seed if params.HasField("seed") else secrets.randbits(DRAWN_SEED_BITS),
            min_p=params.min_p,
            repetition_penalty=params.repetition_penalty if params.HasField("repetition_penalty") else 1.0,
            frequency_penalty=params.frequency_penalty,
            presence_penalty=params.presence_penalty,
            logit_bias=tuple(sorted(params.logit_bias.items())),
            top_logprobs=request.top_logprobs if request.logprobs else -1,
        )
        stops = set(request.stop_token_ids)
        if not request.ignore_eos:
            stops.update(self.eos_token_ids)
        req = Request(request_id, prompt_ids, max_tokens, sampling, frozenset(stops))
        req.stop_strings, req.min_tokens = tuple(request.stop), request.min_tokens
        req.grammar = self._grammar(request)
        req.n = max(request.n, 1)
        if messages is not None and req.grammar is None:  # held to JSON from its first token: no thought
            req.begins_in_thought = begins_in_thought(self.tokenizer, prompt_ids)
        if request.conversation_id:
            self._marks(request, req, messages, kwargs)
        return req
