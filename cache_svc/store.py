"""Snapshots on disk: per key a directory holding a JSON manifest and one checksummed blob per layer range.

Layout under the root: `snapshots/<key>/manifest.json` and `snapshots/<key>/<generation>-<a>-<b>.blob`.
Every file is written under a temporary name in its own directory, fsynced, renamed, and the directory
fsynced; the manifest is renamed last, so a crash leaves the old snapshot or the new one, never half.
What a manifest holds and how it is checked is manifest.py's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import re
import secrets
import threading
import time
from collections.abc import Sequence
from typing import BinaryIO

from cache_svc.manifest import CorruptSnapshot, InvalidSnapshot, Manifest, Shard, SnapshotNotFound

MANIFEST_NAME = "manifest.json"
BLOB_SUFFIX = ".blob"
TMP_SUFFIX = ".tmp"
_KEY_PATTERN = re.compile(r"[0-9a-f]{64}")


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
        file = self._shard_file()
        file.flush()
        os.fsync(file.fileno())
        file.close()
        self._file = None

    def _shard_file(self) -> BinaryIO:
        """The file of the shard being written: open from the shard's start until it is finished."""
        assert self._file is not None, f"shard {self._current} of {self.manifest.key} has no open file"
        return self._file

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
        self._shard_file().write(data)
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
                # Closing flushes what is buffered, which fails on a full disk: the files go regardless.
                with contextlib.suppress(OSError):
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
