from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Checkpoint(_message.Message):
    __slots__ = ("position", "pinned", "root")
    POSITION_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    ROOT_FIELD_NUMBER: _ClassVar[int]
    position: int
    pinned: bool
    root: bool
    def __init__(self, position: _Optional[int] = ..., pinned: _Optional[bool] = ..., root: _Optional[bool] = ...) -> None: ...

class ShardInfo(_message.Message):
    __slots__ = ("layer_begin", "layer_end", "size_bytes", "sha256")
    LAYER_BEGIN_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    layer_begin: int
    layer_end: int
    size_bytes: int
    sha256: str
    def __init__(self, layer_begin: _Optional[int] = ..., layer_end: _Optional[int] = ..., size_bytes: _Optional[int] = ..., sha256: _Optional[str] = ...) -> None: ...

class SnapshotManifest(_message.Message):
    __slots__ = ("tenant", "conversation_id", "token_ids", "checkpoints", "model_fingerprint", "num_layers", "page_size", "dtype", "shards", "attributes", "key", "created_unix_ns")
    class AttributesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    TENANT_FIELD_NUMBER: _ClassVar[int]
    CONVERSATION_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINTS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    ATTRIBUTES_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    conversation_id: str
    token_ids: bytes
    checkpoints: _containers.RepeatedCompositeFieldContainer[Checkpoint]
    model_fingerprint: str
    num_layers: int
    page_size: int
    dtype: str
    shards: _containers.RepeatedCompositeFieldContainer[ShardInfo]
    attributes: _containers.ScalarMap[str, str]
    key: str
    created_unix_ns: int
    def __init__(self, tenant: _Optional[str] = ..., conversation_id: _Optional[str] = ..., token_ids: _Optional[bytes] = ..., checkpoints: _Optional[_Iterable[_Union[Checkpoint, _Mapping]]] = ..., model_fingerprint: _Optional[str] = ..., num_layers: _Optional[int] = ..., page_size: _Optional[int] = ..., dtype: _Optional[str] = ..., shards: _Optional[_Iterable[_Union[ShardInfo, _Mapping]]] = ..., attributes: _Optional[_Mapping[str, str]] = ..., key: _Optional[str] = ..., created_unix_ns: _Optional[int] = ...) -> None: ...

class ShardChunk(_message.Message):
    __slots__ = ("shard", "data")
    SHARD_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    shard: int
    data: bytes
    def __init__(self, shard: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class SnapshotPart(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: SnapshotManifest
    chunk: ShardChunk
    def __init__(self, header: _Optional[_Union[SnapshotManifest, _Mapping]] = ..., chunk: _Optional[_Union[ShardChunk, _Mapping]] = ...) -> None: ...

class PutReply(_message.Message):
    __slots__ = ("key", "size_bytes", "evicted")
    KEY_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    EVICTED_FIELD_NUMBER: _ClassVar[int]
    key: str
    size_bytes: int
    evicted: int
    def __init__(self, key: _Optional[str] = ..., size_bytes: _Optional[int] = ..., evicted: _Optional[int] = ...) -> None: ...

class GetRequest(_message.Message):
    __slots__ = ("tenant", "conversation_id", "layer_begin", "layer_end", "model_fingerprint")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    CONVERSATION_ID_FIELD_NUMBER: _ClassVar[int]
    LAYER_BEGIN_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    conversation_id: str
    layer_begin: int
    layer_end: int
    model_fingerprint: str
    def __init__(self, tenant: _Optional[str] = ..., conversation_id: _Optional[str] = ..., layer_begin: _Optional[int] = ..., layer_end: _Optional[int] = ..., model_fingerprint: _Optional[str] = ...) -> None: ...

class ListRequest(_message.Message):
    __slots__ = ("tenant", "conversation_id", "include_quarantined")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    CONVERSATION_ID_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_QUARANTINED_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    conversation_id: str
    include_quarantined: bool
    def __init__(self, tenant: _Optional[str] = ..., conversation_id: _Optional[str] = ..., include_quarantined: _Optional[bool] = ...) -> None: ...

class SnapshotInfo(_message.Message):
    __slots__ = ("key", "conversation_id", "size_bytes", "last_used_unix_ns", "pinned", "num_tokens", "model_fingerprint", "created_unix_ns", "quarantined")
    KEY_FIELD_NUMBER: _ClassVar[int]
    CONVERSATION_ID_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    LAST_USED_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    QUARANTINED_FIELD_NUMBER: _ClassVar[int]
    key: str
    conversation_id: str
    size_bytes: int
    last_used_unix_ns: int
    pinned: bool
    num_tokens: int
    model_fingerprint: str
    created_unix_ns: int
    quarantined: str
    def __init__(self, key: _Optional[str] = ..., conversation_id: _Optional[str] = ..., size_bytes: _Optional[int] = ..., last_used_unix_ns: _Optional[int] = ..., pinned: _Optional[bool] = ..., num_tokens: _Optional[int] = ..., model_fingerprint: _Optional[str] = ..., created_unix_ns: _Optional[int] = ..., quarantined: _Optional[str] = ...) -> None: ...

class ListReply(_message.Message):
    __slots__ = ("snapshots",)
    SNAPSHOTS_FIELD_NUMBER: _ClassVar[int]
    snapshots: _containers.RepeatedCompositeFieldContainer[SnapshotInfo]
    def __init__(self, snapshots: _Optional[_Iterable[_Union[SnapshotInfo, _Mapping]]] = ...) -> None: ...

class DeleteRequest(_message.Message):
    __slots__ = ("tenant", "conversation_id")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    CONVERSATION_ID_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    conversation_id: str
    def __init__(self, tenant: _Optional[str] = ..., conversation_id: _Optional[str] = ...) -> None: ...

class DeleteReply(_message.Message):
    __slots__ = ("key", "size_bytes")
    KEY_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    key: str
    size_bytes: int
    def __init__(self, key: _Optional[str] = ..., size_bytes: _Optional[int] = ...) -> None: ...

class StatRequest(_message.Message):
    __slots__ = ("tenant",)
    TENANT_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    def __init__(self, tenant: _Optional[str] = ...) -> None: ...

class StatReply(_message.Message):
    __slots__ = ("count", "size_bytes", "budget_bytes", "pinned_bytes", "tenant_count", "tenant_size_bytes")
    COUNT_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    PINNED_BYTES_FIELD_NUMBER: _ClassVar[int]
    TENANT_COUNT_FIELD_NUMBER: _ClassVar[int]
    TENANT_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    count: int
    size_bytes: int
    budget_bytes: int
    pinned_bytes: int
    tenant_count: int
    tenant_size_bytes: int
    def __init__(self, count: _Optional[int] = ..., size_bytes: _Optional[int] = ..., budget_bytes: _Optional[int] = ..., pinned_bytes: _Optional[int] = ..., tenant_count: _Optional[int] = ..., tenant_size_bytes: _Optional[int] = ...) -> None: ...
