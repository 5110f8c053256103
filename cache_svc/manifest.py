"""What a snapshot is: its manifest (checked where it is made), its key, and the errors a caller can act on.

The manifest is stored as JSON (`Manifest.to_json`, `Manifest.from_json`); store.py lays it out on disk.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

FORMAT = 1
DEFAULT_TENANT = "default"
MAX_NAME_CHARS = 1024  # tenant and conversation id
_SHA256_PATTERN = re.compile(r"[0-9a-f]{64}")
LEGACY_ROOTS_ATTRIBUTE = "root_positions"  # "4,10": roots of a manifest written before Checkpoint.root


def snapshot_key(tenant: str, conversation_id: str) -> str:
    """sha256 hex of (tenant, conversation id), each length-prefixed: the one snapshot of a conversation."""
    digest = hashlib.sha256(b"deltaserve.snapshot\0")
    for part in (tenant, conversation_id):
        encoded = part.encode("utf-8")
        digest.update(struct.pack("<I", len(encoded)) + encoded)
    return digest.hexdigest()


def token_key(token_ids: Sequence[int] | np.ndarray) -> str:
    """sha256 hex of the token ids as int32 little-endian bytes: a prefix lookup key stable everywhere."""
    return hashlib.sha256(np.asarray(token_ids, dtype="<i4").tobytes()).hexdigest()


class SnapshotError(Exception):
    """Base of the errors a caller can act on; each maps to one gRPC status."""


class InvalidSnapshot(SnapshotError):
    """Malformed input (a manifest, a chunk, a request): nothing was changed."""


class SnapshotNotFound(SnapshotError):
    """No such snapshot for this tenant (whether or not another tenant has one)."""


class CorruptSnapshot(SnapshotError):
    """A manifest or blob on disk fails its checks: unreadable, truncated, missing or a checksum mismatch."""

    def __init__(self, key: str, message: str, shard: int | None = None) -> None:
        super().__init__(message)
        self.key = key
        self.shard = shard


class LayerRangeError(SnapshotError):
    """A restore asked for layers the snapshot does not have."""


class ModelMismatch(SnapshotError):
    """The snapshot was taken from another model than the one restoring it."""


@dataclass(slots=True, frozen=True)
class Checkpoint:
    position: int
    pinned: bool = False
    root: bool = False  # the end of the system prompt (kept by the planner while its cap allows)


@dataclass(slots=True, frozen=True)
class Shard:
    """The blob of layers [layer_begin, layer_end); blob and sha256 are set once it is on disk."""

    layer_begin: int
    layer_end: int
    size_bytes: int
    sha256: str = ""
    blob: str = ""

    def describe(self, index: int) -> str:
        return f"shard {index} (layers [{self.layer_begin}, {self.layer_end}))"


def _check_name(what: str, value: object) -> None:
    if not isinstance(value, str) or not value:
        raise InvalidSnapshot(f"{what} must be a non-empty string, got {value!r}")
    if len(value) > MAX_NAME_CHARS:
        raise InvalidSnapshot(f"{what} is {len(value)} characters long; at most {MAX_NAME_CHARS}")


def _check_int(what: str, value: object, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise InvalidSnapshot(f"{what} must be an integer >= {minimum}, got {value!r}")


@dataclass(slots=True)
class Manifest:
    """What a snapshot is; checked where it is made, so a Manifest in hand is well-formed."""

    tenant: str
    conversation_id: str
    token_ids: tuple[int, ...]
    checkpoints: tuple[Checkpoint, ...]
    model_fingerprint: str
    num_layers: int
    page_size: int
    dtype: str
    shards: tuple[Shard, ...]
    attributes: dict[str, str] = field(default_factory=dict)
    created_unix_ns: int = 0
    generation: str = ""  # names the blobs of one put; set by the store

    def __post_init__(self) -> None:
        _check_name("tenant", self.tenant)
        _check_name("conversation_id", self.conversation_id)
        _check_name("model_fingerprint", self.model_fingerprint)
        _check_name("dtype", self.dtype)
        _check_int("num_layers", self.num_layers, 1)
        _check_int("page_size", self.page_size, 1)
        if not self.token_ids:
            raise InvalidSnapshot("token_ids is empty: a snapshot holds at least one token")
        if min(self.token_ids) < 0:
            raise InvalidSnapshot(f"token_ids holds a negative id ({min(self.token_ids)})")
        previous = 0
        for checkpoint in self.checkpoints:
            _check_int("checkpoint position", checkpoint.position, 1)
            if not previous < checkpoint.position <= len(self.token_ids):
                raise InvalidSnapshot(
                    f"checkpoint positions must be strictly increasing in [1, {len(self.token_ids)}] "
                    f"(the token count); got {[c.position for c in self.checkpoints]}"
                )
            previous = checkpoint.position
        if not self.shards:
            raise InvalidSnapshot("a snapshot needs at least one shard")
        expected_begin = 0
        for index, shard in enumerate(self.shards):
            if shard.layer_begin != expected_begin or shard.layer_end <= shard.layer_begin:
                raise InvalidSnapshot(
                    f"shards must partition layers [0, {self.num_layers}) in order; {shard.describe(index)} "
                    f"should start at layer {expected_begin} and be non-empty"
                )
            _check_int(f"{shard.describe(index)} size_bytes", shard.size_bytes, 0)
            if shard.sha256 and not _SHA256_PATTERN.fullmatch(shard.sha256):
                raise InvalidSnapshot(f"{shard.describe(index)}: sha256 must be 64 lowercase hex digits")
            expected_begin = shard.layer_end
        if expected_begin != self.num_layers:
            raise InvalidSnapshot(f"shards end at layer {expected_begin}; num_layers is {self.num_layers}")
        for name, value in self.attributes.items():
            if not isinstance(name, str) or not isinstance(value, str):
                raise InvalidSnapshot(f"attributes must map strings to strings, got {name!r}: {value!r}")

    @property
    def key(self) -> str:
        return snapshot_key(self.tenant, self.conversation_id)

    @property
    def size_bytes(self) -> int:
        return sum(shard.size_bytes for shard in self.shards)

    @property
    def pinned(self) -> bool:
        return any(checkpoint.pinned for checkpoint in self.checkpoints)

    def describe(self) -> str:
        return f"snapshot {self.key[:12]} (conversation {self.conversation_id!r})"

    def shards_covering(self, layer_begin: int, layer_end: int) -> list[int]:
        """Indices of the shards that hold any of layers [layer_begin, layer_end)."""
        if not 0 <= layer_begin < layer_end <= self.num_layers:
            raise LayerRangeError(
                f"{self.describe()} has layers [0, {self.num_layers}); "
                f"cannot restore [{layer_begin}, {layer_end})"
            )
        return [
            index
            for index, shard in enumerate(self.shards)
            if shard.layer_begin < layer_end and layer_begin < shard.layer_end
        ]

    def to_json(self) -> bytes:
        return json.dumps(
            {
                "format": FORMAT,
                "key": self.key,
                "tenant": self.tenant,
                "conversation_id": self.conversation_id,
                "token_ids": list(self.token_ids),
                "checkpoints": [
                    {"position": c.position, "pinned": c.pinned, "root": c.root} for c in self.checkpoints
                ],
                "model_fingerprint": self.model_fingerprint,
                "num_layers": self.num_layers,
                "page_size": self.page_size,
                "dtype": self.dtype,
                "attributes": self.attributes,
                "created_unix_ns": self.created_unix_ns,
                "generation": self.generation,
                "shards": [
                    {
                        "layers": [s.layer_begin, s.layer_end],
                        "blob": s.blob,
                        "size_bytes": s.size_bytes,
                        "sha256": s.sha256,
                    }
                    for s in self.shards
                ],
            },
            separators=(",", ":"),
        ).encode()

    @classmethod
    def from_json(cls, key: str, data: bytes) -> Manifest:
        """The manifest stored under `key`; CorruptSnapshot when it does not parse or does not match."""
        try:
            fields = json.loads(data)
            if fields["format"] != FORMAT:
                raise ValueError(f"format {fields['format']}, this version reads {FORMAT}")
            attributes = dict(fields["attributes"])
            # Written before checkpoints had a root flag: the executor kept the roots in this attribute.
            roots = {int(p) for p in attributes.pop(LEGACY_ROOTS_ATTRIBUTE, "").split(",") if p}
            manifest = cls(
                tenant=fields["tenant"],
                conversation_id=fields["conversation_id"],
                token_ids=tuple(fields["token_ids"]),
                checkpoints=tuple(
                    Checkpoint(c["position"], c["pinned"], c.get("root", c["position"] in roots))
                    for c in fields["checkpoints"]
                ),
                model_fingerprint=fields["model_fingerprint"],
                num_layers=fields["num_layers"],
                page_size=fields["page_size"],
                dtype=fields["dtype"],
                shards=tuple(
                    Shard(s["layers"][0], s["layers"][1], s["size_bytes"], s["sha256"], s["blob"])
                    for s in fields["shards"]
                ),
                attributes=attributes,
                created_unix_ns=fields["created_unix_ns"],
                generation=fields["generation"],
            )
        except (ValueError, KeyError, TypeError, IndexError, InvalidSnapshot) as err:
            raise CorruptSnapshot(key, f"snapshot {key[:12]}: manifest unreadable: {err}") from err
        if manifest.key != key or fields["key"] != key:
            raise CorruptSnapshot(key, f"snapshot {key[:12]}: manifest belongs to another key")
        if any(not s.blob or not s.sha256 for s in manifest.shards):
            raise CorruptSnapshot(key, f"{manifest.describe()}: manifest lacks a blob name or checksum")
        return manifest
