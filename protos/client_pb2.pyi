from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason

class ChatMessage(_message.Message):
    __slots__ = ("role", "content", "tool_calls", "tool_call_id", "reasoning")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    REASONING_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    tool_calls: str
    tool_call_id: str
    reasoning: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., tool_calls: _Optional[str] = ..., tool_call_id: _Optional[str] = ..., reasoning: _Optional[str] = ...) -> None: ...

class ChatMessages(_message.Message):
    __slots__ = ("messages", "template_kwargs", "tools")
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    TEMPLATE_KWARGS_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    template_kwargs: str
    tools: str
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., template_kwargs: _Optional[str] = ..., tools: _Optional[str] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "seed", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty", "logit_bias")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    min_p: float
    repetition_penalty: float
    frequency_penalty: float
    presence_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., min_p: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ...) -> None: ...

class ResponseFormat(_message.Message):
    __slots__ = ("json_object", "json_schema")
    class JsonSchema(_message.Message):
        __slots__ = ("name", "schema", "strict")
        NAME_FIELD_NUMBER: _ClassVar[int]
        SCHEMA_FIELD_NUMBER: _ClassVar[int]
        STRICT_FIELD_NUMBER: _ClassVar[int]
        name: str
        schema: str
        strict: bool
        def __init__(self, name: _Optional[str] = ..., schema: _Optional[str] = ..., strict: _Optional[bool] = ...) -> None: ...
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    json_object: bool
    json_schema: ResponseFormat.JsonSchema
    def __init__(self, json_object: _Optional[bool] = ..., json_schema: _Optional[_Union[ResponseFormat.JsonSchema, _Mapping]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "text", "chat", "token_ids", "sampling", "max_tokens", "stop_token_ids", "ignore_eos", "conversation_id", "tenant", "shared_prefix", "stop", "min_tokens", "n", "logprobs", "top_logprobs", "response_format")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    CONVERSATION_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    SHARED_PREFIX_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FORMAT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    chat: ChatMessages
    token_ids: bytes
    sampling: SamplingParams
    max_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    conversation_id: str
    tenant: str
    shared_prefix: SharedPrefix
    stop: _containers.RepeatedScalarFieldContainer[str]
    min_tokens: int
    n: int
    logprobs: bool
    top_logprobs: int
    response_format: ResponseFormat
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., chat: _Optional[_Union[ChatMessages, _Mapping]] = ..., token_ids: _Optional[bytes] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., max_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., conversation_id: _Optional[str] = ..., tenant: _Optional[str] = ..., shared_prefix: _Optional[_Union[SharedPrefix, _Mapping]] = ..., stop: _Optional[_Iterable[str]] = ..., min_tokens: _Optional[int] = ..., n: _Optional[int] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., response_format: _Optional[_Union[ResponseFormat, _Mapping]] = ...) -> None: ...

class SharedPrefix(_message.Message):
    __slots__ = ("messages", "message", "tokens")
    class MessageChars(_message.Message):
        __slots__ = ("message", "chars")
        MESSAGE_FIELD_NUMBER: _ClassVar[int]
        CHARS_FIELD_NUMBER: _ClassVar[int]
        message: int
        chars: int
        def __init__(self, message: _Optional[int] = ..., chars: _Optional[int] = ...) -> None: ...
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    messages: int
    message: SharedPrefix.MessageChars
    tokens: int
    def __init__(self, messages: _Optional[int] = ..., message: _Optional[_Union[SharedPrefix.MessageChars, _Mapping]] = ..., tokens: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "token_ids", "text", "finish_reason", "prompt_tokens", "reused_tokens", "read_tokens", "checkpoint", "diverged_at", "index", "stop_string", "logprobs", "seed", "pinned_prefix", "pin_note", "begins_in_thought")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REUSED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    READ_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    DIVERGED_AT_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    STOP_STRING_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    PINNED_PREFIX_FIELD_NUMBER: _ClassVar[int]
    PIN_NOTE_FIELD_NUMBER: _ClassVar[int]
    BEGINS_IN_THOUGHT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: bytes
    text: str
    finish_reason: FinishReason
    prompt_tokens: int
    reused_tokens: int
    read_tokens: int
    checkpoint: str
    diverged_at: int
    index: int
    stop_string: str
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    seed: int
    pinned_prefix: int
    pin_note: str
    begins_in_thought: bool
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[bytes] = ..., text: _Optional[str] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., prompt_tokens: _Optional[int] = ..., reused_tokens: _Optional[int] = ..., read_tokens: _Optional[int] = ..., checkpoint: _Optional[str] = ..., diverged_at: _Optional[int] = ..., index: _Optional[int] = ..., stop_string: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ..., seed: _Optional[int] = ..., pinned_prefix: _Optional[int] = ..., pin_note: _Optional[str] = ..., begins_in_thought: _Optional[bool] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "token", "token_bytes", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    TOKEN_BYTES_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    token: str
    token_bytes: bytes
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., token: _Optional[str] = ..., token_bytes: _Optional[bytes] = ..., logprob: _Optional[float] = ...) -> None: ...

class TokenLogprobs(_message.Message):
    __slots__ = ("chosen", "top")
    CHOSEN_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    chosen: TokenLogprob
    top: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, chosen: _Optional[_Union[TokenLogprob, _Mapping]] = ..., top: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class ParkRequest(_message.Message):
    __slots__ = ("conversation_id", "tenant")
    CONVERSATION_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    conversation_id: str
    tenant: str
    def __init__(self, conversation_id: _Optional[str] = ..., tenant: _Optional[str] = ...) -> None: ...

class ParkResponse(_message.Message):
    __slots__ = ("bytes", "tokens")
    BYTES_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    bytes: int
    tokens: int
    def __init__(self, bytes: _Optional[int] = ..., tokens: _Optional[int] = ...) -> None: ...

class ResumeRequest(_message.Message):
    __slots__ = ("conversation_id", "tenant")
    CONVERSATION_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    conversation_id: str
    tenant: str
    def __init__(self, conversation_id: _Optional[str] = ..., tenant: _Optional[str] = ...) -> None: ...

class ResumeResponse(_message.Message):
    __slots__ = ("tokens", "checkpoints")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINTS_FIELD_NUMBER: _ClassVar[int]
    tokens: int
    checkpoints: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, tokens: _Optional[int] = ..., checkpoints: _Optional[_Iterable[int]] = ...) -> None: ...

class ListConversationsRequest(_message.Message):
    __slots__ = ("tenant",)
    TENANT_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    def __init__(self, tenant: _Optional[str] = ...) -> None: ...

class Conversation(_message.Message):
    __slots__ = ("conversation_id", "tokens", "checkpoints", "parked", "pages", "pinned_prefix")
    CONVERSATION_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINTS_FIELD_NUMBER: _ClassVar[int]
    PARKED_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    PINNED_PREFIX_FIELD_NUMBER: _ClassVar[int]
    conversation_id: str
    tokens: int
    checkpoints: _containers.RepeatedScalarFieldContainer[int]
    parked: bool
    pages: int
    pinned_prefix: int
    def __init__(self, conversation_id: _Optional[str] = ..., tokens: _Optional[int] = ..., checkpoints: _Optional[_Iterable[int]] = ..., parked: _Optional[bool] = ..., pages: _Optional[int] = ..., pinned_prefix: _Optional[int] = ...) -> None: ...

class ListConversationsResponse(_message.Message):
    __slots__ = ("conversations",)
    CONVERSATIONS_FIELD_NUMBER: _ClassVar[int]
    conversations: _containers.RepeatedCompositeFieldContainer[Conversation]
    def __init__(self, conversations: _Optional[_Iterable[_Union[Conversation, _Mapping]]] = ...) -> None: ...

class DeleteConversationRequest(_message.Message):
    __slots__ = ("conversation_id", "tenant")
    CONVERSATION_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    conversation_id: str
    tenant: str
    def __init__(self, conversation_id: _Optional[str] = ..., tenant: _Optional[str] = ...) -> None: ...

class DeleteConversationResponse(_message.Message):
    __slots__ = ("tokens", "pages", "snapshot_bytes")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_BYTES_FIELD_NUMBER: _ClassVar[int]
    tokens: int
    pages: int
    snapshot_bytes: int
    def __init__(self, tokens: _Optional[int] = ..., pages: _Optional[int] = ..., snapshot_bytes: _Optional[int] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id", "tenant")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    tenant: str
    def __init__(self, request_id: _Optional[str] = ..., tenant: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("aborted",)
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    aborted: bool
    def __init__(self, aborted: _Optional[bool] = ...) -> None: ...

class ModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("name", "vocab_size", "max_seq_len", "eos_token_id", "dtype")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_SEQ_LEN_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    vocab_size: int
    max_seq_len: int
    eos_token_id: int
    dtype: str
    def __init__(self, name: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_seq_len: _Optional[int] = ..., eos_token_id: _Optional[int] = ..., dtype: _Optional[str] = ...) -> None: ...

class ServerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ServerInfo(_message.Message):
    __slots__ = ("version", "page_size", "pool_pages", "free_pages", "slots", "free_slots", "buckets", "running", "waiting", "steps", "device", "state_slots", "free_state_slots")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    POOL_PAGES_FIELD_NUMBER: _ClassVar[int]
    FREE_PAGES_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    FREE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    BUCKETS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    STATE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    FREE_STATE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    version: str
    page_size: int
    pool_pages: int
    free_pages: int
    slots: int
    free_slots: int
    buckets: _containers.RepeatedScalarFieldContainer[int]
    running: int
    waiting: int
    steps: int
    device: str
    state_slots: int
    free_state_slots: int
    def __init__(self, version: _Optional[str] = ..., page_size: _Optional[int] = ..., pool_pages: _Optional[int] = ..., free_pages: _Optional[int] = ..., slots: _Optional[int] = ..., free_slots: _Optional[int] = ..., buckets: _Optional[_Iterable[int]] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., steps: _Optional[int] = ..., device: _Optional[str] = ..., state_slots: _Optional[int] = ..., free_state_slots: _Optional[int] = ...) -> None: ...
