from protos import cache_pb2 as _cache_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DescribeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ExecutorDescription(_message.Message):
    __slots__ = ("model_name", "model_fingerprint", "vocab_size", "max_seq_len", "num_layers", "page_size", "pool_pages", "buckets", "slots", "row_columns", "block_span", "device", "dtype", "layer_begin", "layer_end", "eos_token_id", "eos_token_ids", "state_slots", "snapshots", "stage_group")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_SEQ_LEN_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    POOL_PAGES_FIELD_NUMBER: _ClassVar[int]
    BUCKETS_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    ROW_COLUMNS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SPAN_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    LAYER_BEGIN_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    STATE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOTS_FIELD_NUMBER: _ClassVar[int]
    STAGE_GROUP_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    model_fingerprint: str
    vocab_size: int
    max_seq_len: int
    num_layers: int
    page_size: int
    pool_pages: int
    buckets: _containers.RepeatedScalarFieldContainer[int]
    slots: int
    row_columns: int
    block_span: int
    device: str
    dtype: str
    layer_begin: int
    layer_end: int
    eos_token_id: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    state_slots: int
    snapshots: bool
    stage_group: str
    def __init__(self, model_name: _Optional[str] = ..., model_fingerprint: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_seq_len: _Optional[int] = ..., num_layers: _Optional[int] = ..., page_size: _Optional[int] = ..., pool_pages: _Optional[int] = ..., buckets: _Optional[_Iterable[int]] = ..., slots: _Optional[int] = ..., row_columns: _Optional[int] = ..., block_span: _Optional[int] = ..., device: _Optional[str] = ..., dtype: _Optional[str] = ..., layer_begin: _Optional[int] = ..., layer_end: _Optional[int] = ..., eos_token_id: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., state_slots: _Optional[int] = ..., snapshots: _Optional[bool] = ..., stage_group: _Optional[str] = ...) -> None: ...

class PrefillChunk(_message.Message):
    __slots__ = ("token_ids", "start", "pages", "sample_slot", "state_slot")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_SLOT_FIELD_NUMBER: _ClassVar[int]
    STATE_SLOT_FIELD_NUMBER: _ClassVar[int]
    token_ids: bytes
    start: int
    pages: bytes
    sample_slot: int
    state_slot: int
    def __init__(self, token_ids: _Optional[bytes] = ..., start: _Optional[int] = ..., pages: _Optional[bytes] = ..., sample_slot: _Optional[int] = ..., state_slot: _Optional[int] = ...) -> None: ...

class StepPlan(_message.Message):
    __slots__ = ("seq", "bucket", "slots", "row_runs", "sampler_slots", "sampler_f32", "sampler_i32", "prefill", "mirror", "control_slots", "control_f32", "control_i32", "control_tokens", "control_bias", "control_grammar", "state_copies", "steps")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    BUCKET_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    ROW_RUNS_FIELD_NUMBER: _ClassVar[int]
    SAMPLER_SLOTS_FIELD_NUMBER: _ClassVar[int]
    SAMPLER_F32_FIELD_NUMBER: _ClassVar[int]
    SAMPLER_I32_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    MIRROR_FIELD_NUMBER: _ClassVar[int]
    CONTROL_SLOTS_FIELD_NUMBER: _ClassVar[int]
    CONTROL_F32_FIELD_NUMBER: _ClassVar[int]
    CONTROL_I32_FIELD_NUMBER: _ClassVar[int]
    CONTROL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CONTROL_BIAS_FIELD_NUMBER: _ClassVar[int]
    CONTROL_GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    STATE_COPIES_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    seq: int
    bucket: int
    slots: bytes
    row_runs: bytes
    sampler_slots: bytes
    sampler_f32: bytes
    sampler_i32: bytes
    prefill: _containers.RepeatedCompositeFieldContainer[PrefillChunk]
    mirror: bytes
    control_slots: bytes
    control_f32: bytes
    control_i32: bytes
    control_tokens: bytes
    control_bias: bytes
    control_grammar: _containers.RepeatedCompositeFieldContainer[Grammar]
    state_copies: bytes
    steps: int
    def __init__(self, seq: _Optional[int] = ..., bucket: _Optional[int] = ..., slots: _Optional[bytes] = ..., row_runs: _Optional[bytes] = ..., sampler_slots: _Optional[bytes] = ..., sampler_f32: _Optional[bytes] = ..., sampler_i32: _Optional[bytes] = ..., prefill: _Optional[_Iterable[_Union[PrefillChunk, _Mapping]]] = ..., mirror: _Optional[bytes] = ..., control_slots: _Optional[bytes] = ..., control_f32: _Optional[bytes] = ..., control_i32: _Optional[bytes] = ..., control_tokens: _Optional[bytes] = ..., control_bias: _Optional[bytes] = ..., control_grammar: _Optional[_Iterable[_Union[Grammar, _Mapping]]] = ..., state_copies: _Optional[bytes] = ..., steps: _Optional[int] = ...) -> None: ...

class Grammar(_message.Message):
    __slots__ = ("json_object", "json_schema")
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    json_object: bool
    json_schema: str
    def __init__(self, json_object: _Optional[bool] = ..., json_schema: _Optional[str] = ...) -> None: ...

class GrammarPrepared(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StepOutput(_message.Message):
    __slots__ = ("seq", "tokens", "prefill_tokens", "row_mismatches", "device_wait_us", "logprobs", "logprob_ids")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ROW_MISMATCHES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_WAIT_US_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_IDS_FIELD_NUMBER: _ClassVar[int]
    seq: int
    tokens: bytes
    prefill_tokens: bytes
    row_mismatches: int
    device_wait_us: int
    logprobs: bytes
    logprob_ids: bytes
    def __init__(self, seq: _Optional[int] = ..., tokens: _Optional[bytes] = ..., prefill_tokens: _Optional[bytes] = ..., row_mismatches: _Optional[int] = ..., device_wait_us: _Optional[int] = ..., logprobs: _Optional[bytes] = ..., logprob_ids: _Optional[bytes] = ...) -> None: ...

class ParkPagesRequest(_message.Message):
    __slots__ = ("conversation_id", "tenant", "token_ids", "checkpoints", "pages", "state_slots")
    CONVERSATION_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINTS_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    STATE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    conversation_id: str
    tenant: str
    token_ids: bytes
    checkpoints: _containers.RepeatedCompositeFieldContainer[_cache_pb2.Checkpoint]
    pages: bytes
    state_slots: bytes
    def __init__(self, conversation_id: _Optional[str] = ..., tenant: _Optional[str] = ..., token_ids: _Optional[bytes] = ..., checkpoints: _Optional[_Iterable[_Union[_cache_pb2.Checkpoint, _Mapping]]] = ..., pages: _Optional[bytes] = ..., state_slots: _Optional[bytes] = ...) -> None: ...

class ParkPagesReply(_message.Message):
    __slots__ = ("bytes",)
    BYTES_FIELD_NUMBER: _ClassVar[int]
    bytes: int
    def __init__(self, bytes: _Optional[int] = ...) -> None: ...

class RestorePagesRequest(_message.Message):
    __slots__ = ("conversation_id", "tenant", "pages", "state_slots")
    CONVERSATION_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    STATE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    conversation_id: str
    tenant: str
    pages: bytes
    state_slots: bytes
    def __init__(self, conversation_id: _Optional[str] = ..., tenant: _Optional[str] = ..., pages: _Optional[bytes] = ..., state_slots: _Optional[bytes] = ...) -> None: ...

class RestorePagesReply(_message.Message):
    __slots__ = ("token_ids", "checkpoints")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINTS_FIELD_NUMBER: _ClassVar[int]
    token_ids: bytes
    checkpoints: _containers.RepeatedCompositeFieldContainer[_cache_pb2.Checkpoint]
    def __init__(self, token_ids: _Optional[bytes] = ..., checkpoints: _Optional[_Iterable[_Union[_cache_pb2.Checkpoint, _Mapping]]] = ...) -> None: ...
