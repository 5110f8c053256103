"""Snapshots on disk: per key a directory holding a JSON manifest and one checksummed blob per layer range.

Layout under the root: `snapshots/<key>/manifest.json` and `snapshots/<key>/<generation>-<a>-<b>.blob`.
Every file is written under a temporary name in its own directory, fsynced, renamed, and the directory
fsynced; the manifest is renamed last, so a crash leaves the old snapshot or the new one, never half.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import secrets
import struct
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import BinaryIO

import numpy as np

FORMAT = 1
DEFAULT_TENANT = "default"
MANIFEST_NAME = "manifest.json"
BLOB_SUFFIX = ".blob"
TMP_SUFFIX = ".tmp"
MAX_NAME_CHARS = 1024  # tenant and conversation id
_KEY_PATTERN = re.compile(r"[0-9a-f]{64}")
_SHA256_PATTERN = re.compile(r"[0-9a-f]{64}")


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
                "checkpoints": [{"position": c.position, "pinned": c.pinned} for c in self.checkpoints],
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
            manifest = cls(
                tenant=fields["tenant"],
                conversation_id=fields["conversation_id"],
                token_ids=tuple(fields["token_ids"]),
                checkpoints=tuple(Checkpoint(c["position"], c["pinned"]) for c in fields["checkpoints"]),
                model_fingerprint=fields["model_fingerprint"],
                num_layers=fields["num_layers"],
                page_size=fields["page_size"],
                dtype=fields["dtype"],
                shards=tuple(
                    Shard(s["layers"][0], s["layers"][1], s["size_bytes"], s["sha256"], s["blob"])
                    for s in fields["shards"]
                ),
                attributes=fields["attributes"],
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


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_durably(path: str, data: bytes) -> None:
    """Writes a new file and fsyncs it (not its directory)."""
    with open(path, "xb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _blob_name(generation: str, shard: Shard) -> str:
    return f"{generation}-{shard.layer_begin}-{shard.layer_end}{BLOB_SUFFIX}"


class ShardReader:
    """One shard's blob, opened when the restore began (a later replace or delete does not affect it)."""

    def __init__(self, manifest: Manifest, index: int, file: BinaryIO) -> None:
        self.manifest = manifest
        self.index = index
        self.shard = manifest.shards[index]
        self._file = file

    def _corrupt(self, problem: str) -> CorruptSnapshot:
        return CorruptSnapshot(
            self.manifest.key,
            f"{self.manifest.describe()}, {self.shard.describe(self.index)}: {problem}",
            self.index,
        )

    def read(self) -> bytes:
        """The whole blob, its length and sha256 checked against the manifest (CorruptSnapshot)."""
        data = self._file.read(self.shard.size_bytes)
        if len(data) != self.shard.size_bytes or self._file.read(1):
            size = os.fstat(self._file.fileno()).st_size
            raise self._corrupt(f"blob is {size} bytes, the manifest says {self.shard.size_bytes}")
        digest = hashlib.sha256(data).hexdigest()
        if digest != self.shard.sha256:
            raise self._corrupt(
                f"checksum mismatch (sha256 {digest[:12]}, the manifest says {self.shard.sha256[:12]})"
            )
        return data

    def close(self) -> None:
        self._file.close()


class PendingSnapshot:
    """A put in progress: shards stream to temporary files, in shard order; nothing shows before commit.

    write, commit and abort may come from different threads (an abort while a write runs waits for it).
    `commit` and `SnapshotStore.delete` of one key must not run concurrently (the index serializes them).
    """

    def __init__(self, store: SnapshotStore, manifest: Manifest) -> None:
        self.manifest = manifest
        self._store = store
        self._dir = store.snapshot_dir(manifest.key)
        self._generation = f"{time.time_ns():x}{secrets.token_hex(4)}"
        self._current = -1  # the shard being written
        self._file: BinaryIO | None = None
        self._hash = hashlib.sha256()
        self._written = 0
        self._digests: list[str] = []
        self._temporary: list[str] = []  # every path this put created, removed on abort
        self._done = False
        self._lock = threading.Lock()

    def _tmp_path(self, index: int) -> str:
        return os.path.join(self._dir, _blob_name(self._generation, self.manifest.shards[index]) + TMP_SUFFIX)

    def _finish_current(self) -> None:
        """Closes the shard being written once it holds exactly its declared bytes."""
        shard = self.manifest.shards[self._current]
        if self._written != shard.size_bytes:
            raise InvalidSnapshot(
                f"{shard.describe(self._current)}: received {self._written} bytes, "
                f"the header says {shard.size_bytes}"
            )
        digest = self._hash.hexdigest()
        if shard.sha256 and digest != shard.sha256:
            raise InvalidSnapshot(
                f"{shard.describe(self._current)}: received bytes have sha256 {digest[:12]}, "
                f"the header says {shard.sha256[:12]}"
            )
        self._digests.append(digest)
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        self._file = None

    def _start(self, index: int) -> None:
        if self._current == -1:
            self._store.make_snapshot_dir(self.manifest.key)
        path = self._tmp_path(index)
        self._temporary.append(path)
        self._file = open(path, "xb")
        self._current = index
        self._hash = hashlib.sha256()
        self._written = 0

    def _advance_to(self, index: int) -> None:
        """Closes the shards before `index` (empty ones skipped by the stream included)."""
        while self._current < index:
            if self._current >= 0:
                self._finish_current()
            self._start(self._current + 1)

    def write(self, shard: int, data: bytes) -> None:
        """Appends `data` to shard `shard`; InvalidSnapshot for a chunk out of order or past its size."""
        with self._lock:
            self._write(shard, data)

    def _write(self, shard: int, data: bytes) -> None:
        if self._done:
            raise InvalidSnapshot("this put is already committed or aborted")
        if not 0 <= shard < len(self.manifest.shards):
            raise InvalidSnapshot(
                f"chunk for shard {shard}: the header declares {len(self.manifest.shards)} shards"
            )
        if shard < self._current:
            raise InvalidSnapshot(
                f"chunk for shard {shard} after shard {self._current}: chunks come in shard order"
            )
        self._advance_to(shard)
        declared = self.manifest.shards[shard].size_bytes
        if self._written + len(data) > declared:
            raise InvalidSnapshot(
                f"{self.manifest.shards[shard].describe(shard)}: "
                f"more than the {declared} bytes the header declares"
            )
        self._file.write(data)
        self._hash.update(data)
        self._written += len(data)

    def commit(self) -> Manifest:
        """Publishes the snapshot atomically, replacing the key's older one; returns the stored manifest."""
        with self._lock:
            return self._commit()

    def _commit(self) -> Manifest:
        if self._done:
            raise InvalidSnapshot("this put is already committed or aborted")
        self._advance_to(len(self.manifest.shards) - 1)
        self._finish_current()
        shards = []
        for index, shard in enumerate(self.manifest.shards):
            blob = _blob_name(self._generation, shard)
            os.replace(self._tmp_path(index), os.path.join(self._dir, blob))
            self._temporary[index] = os.path.join(self._dir, blob)
            shards.append(
                Shard(shard.layer_begin, shard.layer_end, shard.size_bytes, self._digests[index], blob)
            )
        _fsync_dir(self._dir)
        stored = dataclasses.replace(
            self.manifest, shards=tuple(shards), created_unix_ns=time.time_ns(), generation=self._generation
        )
        previous = self._store.previous_manifest(self.manifest.key)
        self._publish_manifest(stored)
        if previous is not None:  # the new manifest is in place: the older blobs are garbage now
            for shard in previous.shards:
                _unlink_quietly(os.path.join(self._dir, shard.blob))
        return stored

    def _publish_manifest(self, manifest: Manifest) -> None:
        """The commit point: the manifest replaces the older one in one rename."""
        tmp = os.path.join(self._dir, f"{MANIFEST_NAME}.{self._generation}{TMP_SUFFIX}")
        self._temporary.append(tmp)
        _write_durably(tmp, manifest.to_json())
        os.replace(tmp, os.path.join(self._dir, MANIFEST_NAME))
        self._done = True  # published: from here on, abort must not take the blobs back
        self._temporary.clear()
        _fsync_dir(self._dir)

    def abort(self) -> None:
        """Removes what this put wrote; the key's older snapshot, if any, is untouched."""
        with self._lock:
            if self._done:
                return
            self._done = True
            if self._file is not None:
                self._file.close()
                self._file = None
            for path in self._temporary:
                _unlink_quietly(path)


class SnapshotStore:
    """The snapshot directories under `root/snapshots`; no index, no budget (see index.py)."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.snapshots_dir = os.path.join(root, "snapshots")
        os.makedirs(self.snapshots_dir, exist_ok=True)

    def snapshot_dir(self, key: str) -> str:
        if not _KEY_PATTERN.fullmatch(key):
            raise InvalidSnapshot(f"not a snapshot key: {key!r}")
        return os.path.join(self.snapshots_dir, key)

    def make_snapshot_dir(self, key: str) -> None:
        try:
            os.mkdir(self.snapshot_dir(key))
        except FileExistsError:
            return
        _fsync_dir(self.snapshots_dir)

    def keys(self) -> list[str]:
        """Every snapshot directory, with or without a manifest."""
        return sorted(name for name in os.listdir(self.snapshots_dir) if _KEY_PATTERN.fullmatch(name))

    def manifest_stamp(self, key: str) -> str | None:
        """Size and mtime of the manifest file (None when absent): tells when it changed behind the index."""
        try:
            stat = os.stat(os.path.join(self.snapshot_dir(key), MANIFEST_NAME))
        except FileNotFoundError:
            return None
        return f"{stat.st_size}:{stat.st_mtime_ns}"

    def begin_put(self, manifest: Manifest) -> PendingSnapshot:
        return PendingSnapshot(self, manifest)

    def put(self, manifest: Manifest, shards: Sequence[bytes]) -> Manifest:
        """Stores a whole snapshot at once; see PendingSnapshot for streaming."""
        if len(shards) != len(manifest.shards):
            raise InvalidSnapshot(f"{len(shards)} shard blobs for {len(manifest.shards)} declared shards")
        pending = self.begin_put(manifest)
        try:
            for index, data in enumerate(shards):
                pending.write(index, data)
            return pending.commit()
        finally:
            pending.abort()

    def read_manifest(self, key: str) -> Manifest:
        try:
            with open(os.path.join(self.snapshot_dir(key), MANIFEST_NAME), "rb") as f:
                data = f.read()
        except FileNotFoundError:
            raise SnapshotNotFound(f"no snapshot {key[:12]}") from None
        return Manifest.from_json(key, data)

    def previous_manifest(self, key: str) -> Manifest | None:
        """The key's current manifest, None when absent or unreadable (its blobs are then swept at start)."""
        try:
            return self.read_manifest(key)
        except (SnapshotNotFound, CorruptSnapshot):
            return None

    def open_shards(self, manifest: Manifest, indices: Sequence[int]) -> list[ShardReader]:
        """Opens the blobs of the shards `indices` only; a missing blob is CorruptSnapshot."""
        readers: list[ShardReader] = []
        try:
            for index in indices:
                path = os.path.join(self.snapshot_dir(manifest.key), manifest.shards[index].blob)
                try:
                    file = open(path, "rb")
                except FileNotFoundError:
                    raise CorruptSnapshot(
                        manifest.key,
                        f"{manifest.describe()}, {manifest.shards[index].describe(index)}: blob is missing",
                        index,
                    ) from None
                readers.append(ShardReader(manifest, index, file))
        except BaseException:
            for reader in readers:
                reader.close()
            raise
        return readers

    def read(self, key: str, layers: tuple[int, int] | None = None) -> tuple[Manifest, list[bytes]]:
        """The manifest and the checked blobs of the shards covering `layers` (all when None)."""
        manifest = self.read_manifest(key)
        indices = manifest.shards_covering(*(layers or (0, manifest.num_layers)))
        readers = self.open_shards(manifest, indices)
        try:
            return manifest, [reader.read() for reader in readers]
        finally:
            for reader in readers:
                reader.close()

    def delete(self, key: str) -> bool:
        """Removes the manifest first (the snapshot is gone at that instant), then its blobs."""
        manifest = self.previous_manifest(key)
        directory = self.snapshot_dir(key)
        try:
            os.unlink(os.path.join(directory, MANIFEST_NAME))
        except FileNotFoundError:
            return False
        _fsync_dir(directory)
        for shard in manifest.shards if manifest is not None else ():
            _unlink_quietly(os.path.join(directory, shard.blob))
        return True  # the empty directory stays until the next start's sweep: a put may be writing in it

    def sweep(self, key: str, keep_generation: str | None) -> list[str]:
        """At start, before any put: removes temporary files and blobs of other generations than the
        manifest's (what a crash left); a directory without a manifest goes whole. Returns what it removed."""
        directory = self.snapshot_dir(key)
        has_manifest = os.path.exists(os.path.join(directory, MANIFEST_NAME))
        removed = []
        for name in os.listdir(directory):
            if name == MANIFEST_NAME and has_manifest:
                continue
            keep = (
                keep_generation is not None
                and has_manifest
                and name.endswith(BLOB_SUFFIX)
                and name.startswith(f"{keep_generation}-")
            )
            if not keep:
                _unlink_quietly(os.path.join(directory, name))
                removed.append(name)
        if not has_manifest:
            os.rmdir(directory)
        return removed
