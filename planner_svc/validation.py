"""Every field of a GenerateRequest checked before anything else runs: pure, no gRPC, no tokenizer.

A request that fails gets INVALID_ARGUMENT with a message naming the field and the value it had. The
checks here are the planner's; the executor checks the sampler fields again where it reads them
(executor_svc/plan.py: temperature and top_p finite and in range, top_k >= 0, last token in the vocabulary).

The text bound: one token stands for at most `longest_token_bytes` bytes of text (the longest vocabulary
entry's UTF-8 length: byte-level BPE and SentencePiece spell a byte with one or more UTF-8 bytes, so this
is never below the true figure), so a prompt that fits in the context is at most max_seq_len x that many
bytes. Twice that (a margin for normalizers that shrink text) is refused before tokenizing. For SmolLM2
(context 8192, longest entry 162 bytes) that is 2.65 MB.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from planner_svc.schema_limits import MAX_SCHEMA_DEPTH, json_depth, schema_limit_error
from protos import client_pb2

TEMPERATURE_MAX = 100.0  # beyond it every token is as likely as any other: no use, only a typo
REPETITION_PENALTY_MAX = 10.0  # as for the temperature: beyond it, a typo
# below it, a typo too; near 0 a logit divided by it overflows to infinity and the draw degenerates
REPETITION_PENALTY_MIN = 1 / REPETITION_PENALTY_MAX
# a temperature below it samples as greedy (as vLLM's): dividing the logits by less overflows them
GREEDY_BELOW = 1e-5
PENALTY_BOUND = 2.0  # frequency and presence penalties, as OpenAI bounds them
LOGIT_BIAS_BOUND = 100.0
MAX_LOGIT_BIAS = 300  # entries, as OpenAI
MAX_STOP_STRINGS = 4
MAX_STOP_CHARS = 256
MAX_CHOICES = 16
MAX_TOP_LOGPROBS = 20
MAX_STOP_IDS = 1024
MAX_ID_CHARS = 256  # request ids, conversation ids and tenants
TEXT_MARGIN = 2


class InvalidRequest(ValueError):
    """A request field out of range (INVALID_ARGUMENT); the message names the field and its value."""


@dataclass(frozen=True, slots=True)
class Limits:
    vocab_size: int
    max_seq_len: int
    max_text_bytes: int  # prompt text (all of a chat's messages together) refused beyond this


UNKNOWN_TOKEN_BYTES = 256  # assumed for a tokenizer that does not list its vocabulary


def longest_token_bytes(tokenizer) -> int:
    """The most text bytes one token can stand for (an upper bound; see the module's docstring)."""
    get_vocab = getattr(tokenizer, "get_vocab", None)
    if get_vocab is None:
        return UNKNOWN_TOKEN_BYTES
    return max((len(token.encode("utf-8")) for token in get_vocab()), default=1)


def text_byte_limit(max_seq_len: int, token_bytes: int) -> int:
    return max_seq_len * max(1, token_bytes) * TEXT_MARGIN


def limits_for(tokenizer, vocab_size: int, max_seq_len: int) -> Limits:
    return Limits(vocab_size, max_seq_len, text_byte_limit(max_seq_len, longest_token_bytes(tokenizer)))


def _bad(field: str, value, rule: str) -> InvalidRequest:
    return InvalidRequest(f"{field} {rule}, got {value!r}")


def check_sampling(params: client_pb2.SamplingParams, vocab_size: int) -> None:
    temperature = params.temperature
    if not (math.isfinite(temperature) and 0.0 <= temperature <= TEMPERATURE_MAX):
        raise _bad(
            "sampling.temperature",
            temperature,
            f"must be finite and in [0, {TEMPERATURE_MAX:g}] (0 is greedy)",
        )
    if params.HasField("top_p"):
        top_p = params.top_p
        if not (math.isfinite(top_p) and 0.0 < top_p <= 1.0):
            raise _bad("sampling.top_p", top_p, "must be in (0, 1]")
    if params.top_k < 0:
        raise _bad("sampling.top_k", params.top_k, "must be >= 0 (0 is no cut)")
    # seed: any uint64 (the wire type admits nothing else); unset, intake draws one
    if not (math.isfinite(params.min_p) and 0.0 <= params.min_p <= 1.0):
        raise _bad("sampling.min_p", params.min_p, "must be in [0, 1] (0 is off)")
    if params.HasField("repetition_penalty"):
        penalty = params.repetition_penalty
        if not (math.isfinite(penalty) and REPETITION_PENALTY_MIN <= penalty <= REPETITION_PENALTY_MAX):
            raise _bad(
                "sampling.repetition_penalty",
                penalty,
                f"must be in [{REPETITION_PENALTY_MIN:g}, {REPETITION_PENALTY_MAX:g}] (1 is off)",
            )
    for name in ("frequency_penalty", "presence_penalty"):
        value = getattr(params, name)
        if not (math.isfinite(value) and -PENALTY_BOUND <= value <= PENALTY_BOUND):
            raise _bad(f"sampling.{name}", value, f"must be in [-{PENALTY_BOUND:g}, {PENALTY_BOUND:g}]")
    if len(params.logit_bias) > MAX_LOGIT_BIAS:
        raise InvalidRequest(
            f"sampling.logit_bias has {len(params.logit_bias)} entries; at most {MAX_LOGIT_BIAS}"
        )
    for token, bias in params.logit_bias.items():
        if not 0 <= token < vocab_size:
            raise _bad(
                f"sampling.logit_bias[{token}]",
                token,
                f"names a token outside the vocabulary [0, {vocab_size})",
            )
        if not (math.isfinite(bias) and -LOGIT_BIAS_BOUND <= bias <= LOGIT_BIAS_BOUND):
            raise _bad(
                f"sampling.logit_bias[{token}]",
                bias,
                f"must be in [-{LOGIT_BIAS_BOUND:g}, {LOGIT_BIAS_BOUND:g}]",
            )


def check_controls(request: client_pb2.GenerateRequest) -> None:
    """Stop strings, min_tokens, n, logprobs and response_format (max_tokens already checked)."""
    if len(request.stop) > MAX_STOP_STRINGS:
        raise InvalidRequest(f"stop has {len(request.stop)} strings; at most {MAX_STOP_STRINGS}")
    for index, stop in enumerate(request.stop):
        if not 1 <= len(stop) <= MAX_STOP_CHARS:
            raise _bad(f"stop[{index}]", stop, f"must have 1 to {MAX_STOP_CHARS} characters")
    if request.min_tokens < 0 or (request.max_tokens and request.min_tokens > request.max_tokens):
        raise _bad("min_tokens", request.min_tokens, f"must be in [0, max_tokens = {request.max_tokens}]")
    if not 0 <= request.n <= MAX_CHOICES:
        raise _bad("n", request.n, f"must be in [1, {MAX_CHOICES}] (0 means 1)")
    if request.n > 1 and request.conversation_id:
        raise InvalidRequest(
            f"n is {request.n} but a conversation's turn has one answer: leave conversation_id empty"
        )
    if not 0 <= request.top_logprobs <= MAX_TOP_LOGPROBS:
        raise _bad("top_logprobs", request.top_logprobs, f"must be in [0, {MAX_TOP_LOGPROBS}]")
    if request.top_logprobs and not request.logprobs:
        raise InvalidRequest(f"top_logprobs is {request.top_logprobs} but logprobs is off: set logprobs too")
    if request.HasField("response_format"):
        check_response_format(request.response_format)
        check_grammar_can_end(request)


def check_grammar_can_end(request: client_pb2.GenerateRequest) -> None:
    """A JSON grammar ends its output with end-of-sequence: once the value is complete, that is the only
    token its mask allows (executor_svc/grammars.py). ignore_eos would not stop there (the grammar's matcher
    ends, and the output runs on unconstrained), and min_tokens > 0 masks end-of-sequence and the stop ids
    until then (a complete value would leave no token to sample): both are refused with a grammar."""
    if request.response_format.WhichOneof("format") is None:
        return
    if request.ignore_eos:
        raise InvalidRequest(
            "response_format and ignore_eos conflict: structured output ends at end-of-sequence once its JSON "
            "value is complete; leave ignore_eos off"
        )
    if request.min_tokens > 0:
        raise InvalidRequest(
            f"response_format and min_tokens conflict: min_tokens {request.min_tokens} masks "
            "end-of-sequence, the only token a complete JSON value allows; leave min_tokens at 0"
        )


def json_field(field: str, text: str, max_depth: int) -> Any:
    """`text` read as JSON; InvalidRequest naming `field` where it is not JSON or nests its objects and arrays
    deeper than `max_depth` (the outermost counts one)."""
    try:
        value = json.loads(text)
    except ValueError as error:  # JSONDecodeError
        raise InvalidRequest(f"{field} is not JSON: {error}") from None
    except RecursionError:
        raise InvalidRequest(f"{field} nests deeper than {max_depth} objects and arrays") from None
    if json_depth(value) > max_depth:
        raise InvalidRequest(f"{field} nests deeper than {max_depth} objects and arrays")
    return value


def check_response_format(response_format: client_pb2.ResponseFormat) -> None:
    """The form of the format; what a schema asks for is checked when its grammar is compiled."""
    which = response_format.WhichOneof("format")
    if which == "json_object" and not response_format.json_object:
        raise InvalidRequest("response_format.json_object must be true when set (leave it unset for text)")
    if which == "json_schema":
        field = "response_format.json_schema.schema"
        schema = json_field(field, response_format.json_schema.schema, MAX_SCHEMA_DEPTH)
        if not isinstance(schema, dict):
            raise _bad(field, schema, "must be a JSON object")
        reason = schema_limit_error(schema)
        if reason is not None:
            raise InvalidRequest(f"{field} {reason}")


def _check_id(field: str, value: str) -> None:
    if len(value) > MAX_ID_CHARS:
        raise InvalidRequest(f"{field} has {len(value)} characters; at most {MAX_ID_CHARS}")


def check_named(field: str, value: str) -> None:
    """A call naming what it acts on (a conversation, a request): not empty, not over MAX_ID_CHARS (never echoed
    whole)."""
    if not value:
        raise InvalidRequest(f"{field} is empty")
    _check_id(field, value)


def check_generate(request: client_pb2.GenerateRequest, limits: Limits) -> None:
    """Everything that can be checked before the prompt is tokenized."""
    _check_id("request_id", request.request_id)
    _check_id("conversation_id", request.conversation_id)
    _check_id("tenant", request.tenant)
    check_sampling(request.sampling, limits.vocab_size)
    if request.max_tokens < 0:
        raise _bad("max_tokens", request.max_tokens, "must be positive (or 0: up to the context's end)")
    if request.max_tokens >= limits.max_seq_len:
        raise InvalidRequest(
            f"max_tokens {request.max_tokens} leaves no room for a prompt: the model's context is "
            f"{limits.max_seq_len} tokens (prompt + max_tokens at most)"
        )
    check_controls(request)
    stops = request.stop_token_ids
    if len(stops) > MAX_STOP_IDS:
        raise InvalidRequest(f"stop_token_ids has {len(stops)} ids; at most {MAX_STOP_IDS}")
    for index, token in enumerate(stops):
        if not 0 <= token < limits.vocab_size:
            raise _bad(
                f"stop_token_ids[{index}]", token, f"is outside the vocabulary [0, {limits.vocab_size})"
            )
    kind = request.WhichOneof("prompt")
    if kind == "text":
        _check_text_size("text", len(request.text.encode("utf-8")), limits)
    elif kind == "chat":
        texts = [request.chat.tools, request.chat.template_kwargs]
        texts += [
            t
            for m in request.chat.messages
            for t in (m.role, m.content, m.tool_calls, m.tool_call_id, m.reasoning)
        ]
        size = sum(len(text.encode("utf-8")) for text in texts)
        _check_text_size("chat", size, limits)
        # a chat template spends a token or more a message
        if len(request.chat.messages) > limits.max_seq_len:
            raise InvalidRequest(
                f"chat has {len(request.chat.messages)} messages: more than the model's context of "
                f"{limits.max_seq_len} tokens could hold (each message takes at least one)"
            )
        for index, message in enumerate(request.chat.messages):
            if not message.role:
                raise InvalidRequest(f"chat.messages[{index}].role is empty; every chat message needs a role")
            if message.reasoning and message.role != "assistant":
                raise InvalidRequest(
                    f"chat.messages[{index}].reasoning: only an assistant's message has a thought, not a "
                    f"{message.role!r} one"
                )
    elif kind == "token_ids":
        size = len(request.token_ids)
        if size % 4:
            raise InvalidRequest(f"token_ids has {size} bytes: not packed int32 (a multiple of 4 bytes)")
        if size // 4 >= limits.max_seq_len:
            raise InvalidRequest(
                f"the prompt has {size // 4} tokens; the model's context is {limits.max_seq_len}"
            )
    if request.HasField("shared_prefix"):
        if not request.conversation_id:
            raise InvalidRequest(
                "shared_prefix pins the start of a conversation's history: give conversation_id too"
            )
        prefix = request.shared_prefix
        which = prefix.WhichOneof("prefix")
        if which == "message":
            for name in ("message", "chars"):
                if getattr(prefix.message, name) < 0:
                    raise _bad(f"shared_prefix.message.{name}", getattr(prefix.message, name), "must be >= 0")
        elif which is not None and getattr(prefix, which) < 0:
            raise _bad(f"shared_prefix.{which}", getattr(prefix, which), "must be >= 0")


def _check_text_size(field: str, size: int, limits: Limits) -> None:
    if size > limits.max_text_bytes:
        raise InvalidRequest(
            f"{field} is {size} bytes: more than the model's context of {limits.max_seq_len} tokens could "
            f"hold (at most {limits.max_text_bytes} bytes); refused before tokenizing"
        )


def unset_max_tokens(prompt_len: int, max_seq_len: int, default: int, min_tokens: int) -> int:
    """max_tokens for a request that left it unset: `default` (--default-max-tokens), or its min_tokens if more,
    at most what the context leaves after the prompt; with no default, all of that (OpenAI's default)."""
    fit = max(1, max_seq_len - prompt_len)
    return min(fit, max(default, min_tokens)) if default else fit


def check_min_tokens(min_tokens: int, max_tokens: int) -> None:
    """After tokenizing, where max_tokens was 0 (the rest of the context): min_tokens fits in that rest."""
    if min_tokens > max_tokens:
        raise InvalidRequest(
            f"min_tokens is {min_tokens}: more than the {max_tokens} output tokens the context leaves after "
            "the prompt"
        )


def check_length(prompt_len: int, max_tokens: int, max_seq_len: int) -> None:
    """After tokenizing: the prompt and everything it may generate fit in the context (as vLLM and OpenAI
    refuse prompt + max_tokens beyond it, rather than clamp and reserve)."""
    if prompt_len >= max_seq_len:
        raise InvalidRequest(f"the prompt has {prompt_len} tokens; the model's context is {max_seq_len}")
    if prompt_len + max_tokens > max_seq_len:
        raise InvalidRequest(
            f"the prompt has {prompt_len} tokens and max_tokens is {max_tokens}: more than the model's "
            f"context of {max_seq_len} tokens (max_tokens at most {max_seq_len - prompt_len})"
        )
