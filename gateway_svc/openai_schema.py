"""The OpenAI request bodies the gateway accepts (pydantic), with deltaserve's extension fields.

Fields the gateway cannot honour (translate.UNSUPPORTED: OpenAI's, some declared here, and vLLM's extensions)
are refused with a 400 naming them, never served as if they were not there. Other fields unknown here are
ignored (clients and SDKs send new harmless ones), and logged. Types are strict (a string or a boolean is no
number, a number no boolean), and NaN and infinities (which Python's JSON parser reads) are no numbers.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

# The planner's wire types: a larger value is a 400 naming its field, not the protobuf encoder's error.
Int32 = Annotated[int, Field(ge=0, le=2**31 - 1)]
Uint64 = Annotated[int, Field(ge=0, le=2**64 - 1)]


class ContentPart(BaseModel):
    """One part of a message's content; only text parts are served (translate.py refuses the others)."""

    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    """One message; `content` as a string or a list of text parts (joined), null for an empty one; an
    assistant's calls of tools and its thought (as answers give it, under either name), or the id of the call a
    tool message answers."""

    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)
    role: Annotated[str, Field(min_length=1)]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None
    tool_call_id: str | None = None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)
    include_usage: bool = False


class SharedPrefixSpec(BaseModel):
    """The read-only start of a conversation's prompt that many requests share (one of the three forms)."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
    messages: Int32 | None = None  # the first K chat messages
    message: Int32 | None = None  # with chars: the messages before I and N characters of message I
    chars: Int32 | None = None
    tokens: Int32 | None = None  # the first N prompt tokens

    def as_mapping(self) -> dict[str, int]:
        return {name: value for name, value in self.model_dump().items() if value is not None}


class GenerationBody(BaseModel):
    """What chat and text completions share: sampling, streaming, and deltaserve's extensions."""

    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)
    model: str
    # OpenAI's nullable fields: null is the default, as if the field were not sent
    max_tokens: Annotated[int, Field(ge=1, le=2**31 - 1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=100.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=-1, le=2**31 - 1)] | None = None  # not OpenAI's; as vLLM's, -1 or 0 is off
    seed: Uint64 | None = None
    n: Annotated[int, Field(ge=1, le=16)] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None
    ignore_eos: bool | None = None  # vLLM's extension: do not stop at the model's end-of-sequence token
    stop_token_ids: list[Int32] | None = None  # vLLM's extension
    return_token_ids: bool | None = None  # vLLM's extension: each choice (and delta) carries its token ids
    # deltaserve: continue a conversation (the prompt carries the whole history), and pin its shared start
    conversation_id: Annotated[str, Field(max_length=256)] | None = None
    # deltaserve: the tenant the request acts for, as GenerateRequest.tenant (only a service key may name another
    # than its own: PERMISSION_DENIED, a 403)
    tenant: Annotated[str, Field(max_length=256)] | None = None
    shared_prefix: SharedPrefixSpec | None = None
    stop: str | list[str] | None = None  # stop strings (the planner takes at most 4)
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # token id (as a string, as OpenAI's) -> bias
    min_p: float | None = None  # vLLM's extension
    repetition_penalty: float | None = None  # vLLM's extension
    min_tokens: Int32 | None = None  # vLLM's extension
    response_format: dict[str, Any] | None = None  # structured output: json_object, or json_schema
    # Declared to be refused by name (translate.UNSUPPORTED), never silently dropped.
    best_of: int | None = None


class ChatCompletionBody(GenerationBody):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1, le=2**31 - 1)] | None = None
    logprobs: bool | None = None
    top_logprobs: Int32 | None = None
    # vLLM's extension: more variables for the chat template, such as Qwen3's enable_thinking (the planner
    # checks the names)
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None  # function tools, given to the chat template
    include_reasoning: bool | None = None  # vLLM's: false leaves the thought out (still apart from content)
    tool_choice: str | dict[str, Any] | None = None
    functions: list[Any] | None = None
    function_call: Any = None
    audio: Any = None
    modalities: list[str] | None = None
    prediction: Any = None


Prompt = str | Annotated[list[Int32], Field(min_length=1)] | list[str] | list[list[Int32]]


class CompletionBody(GenerationBody):
    prompt: Prompt
    logprobs: Int32 | None = None  # the chosen token's logprob and this many alternatives
    echo: bool | None = None
    suffix: str | None = None
