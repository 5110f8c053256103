"""The SQLite index over the snapshot store: owners, sizes, last use, pins; the byte budget and LRU eviction.

The store's manifests are the truth: at open the index is checked against them (rebuilt whole when its
file is missing or corrupt) and what a crash left in the snapshot directories is swept.
"""

from __future__ import annotations

import os
import sqlite3
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import structlog

from cache_svc.budget import Held, choose_victims
from cache_svc.manifest import (
    CorruptSnapshot,
    Manifest,
    ModelMismatch,
    SnapshotNotFound,
    snapshot_key,
)
from cache_svc.quarantine import set_aside
from cache_svc.store import PendingSnapshot, ShardReader, SnapshotStore

log = structlog.get_logger("deltaserve.cache.index")

INDEX_NAME = "index.sqlite3"
SCHEMA_VERSION = 2  # 2: `restored`
_SCHEMA = """
CREATE TABLE snapshots (
    key TEXT PRIMARY KEY,
    tenant TEXT NOT NULL,
    conversation_id TEXT NOT NULL,
    size_bytes INTEGER NOT NULL,
    last_used_ns INTEGER NOT NULL,  -- unix ns, strictly increasing across uses: the LRU order
    pinned INTEGER NOT NULL,
    num_tokens INTEGER NOT NULL,
    model_fingerprint TEXT NOT NULL,
    created_ns INTEGER NOT NULL,
    generation TEXT NOT NULL,
    manifest_stamp TEXT NOT NULL,  -- size:mtime_ns of manifest.json when indexed
    -- read by a restore since it was put: its conversation is back in a KV pool, this a spare copy, evicted
    -- before the only copies of parked conversations
    restored INTEGER NOT NULL
);
CREATE INDEX snapshots_by_owner ON snapshots (tenant, conversation_id);
CREATE INDEX snapshots_by_use ON snapshots (pinned, last_used_ns);
"""
_COLUMNS = (
    "key",
    "tenant",
    "conversation_id",
    "size_bytes",
    "last_used_ns",
    "pinned",
    "num_tokens",
    "model_fingerprint",
    "created_ns",
    "generation",
    "manifest_stamp",
    "restored",
)


@dataclass(slots=True, frozen=True)
class IndexEntry:
    key: str
    tenant: str
    conversation_id: str
    size_bytes: int
    last_used_ns: int
    pinned: bool
    num_tokens: int
    model_fingerprint: str
    created_ns: int
    generation: str
    manifest_stamp: str
    restored: bool


@dataclass(slots=True, frozen=True)
class CacheStat:
    count: int
    size_bytes: int
    budget_bytes: int
    pinned_bytes: int
    tenant_count: int
    tenant_size_bytes: int


def _entry(row: Sequence) -> IndexEntry:
    fields = dict(zip(_COLUMNS, row))
    fields["pinned"], fields["restored"] = bool(fields["pinned"]), bool(fields["restored"])
    return IndexEntry(**fields)


class SnapshotIndex:
    """The cache's catalog: every operation that changes the store goes through here, under one lock.

    Blob bytes stream outside the lock (PendingSnapshot.write, ShardReader.read); the lock covers the
    short steps that must not interleave: a put's commit with its evictions, a delete, a restore's open.
    Safe to call from several threads.
    """

    def __init__(self, root: str, budget_bytes: int, tenant_budget_bytes: int | None = None) -> None:
        if budget_bytes < 1 or (tenant_budget_bytes is not None and tenant_budget_bytes < 1):
            raise ValueError(f"budgets must be positive, got {budget_bytes} and {tenant_budget_bytes}")
        os.makedirs(root, exist_ok=True)
        self.budget_bytes = budget_bytes
        self.tenant_budget_bytes = tenant_budget_bytes  # each tenant's share; None: the global budget
        self._budgets = (budget_bytes, tenant_budget_bytes)
        self.store = SnapshotStore(root)
        self.path = os.path.join(root, INDEX_NAME)
        self._lock = threading.Lock()
        self._db, self.rebuilt = self._open_db()
        self._reconcile()
        latest_use = "SELECT COALESCE(MAX(last_used_ns), 0) FROM snapshots"
        self._clock_ns = self._db.execute(latest_use).fetchone()[0]

    # -- opening --------------------------------------------------------------------------------------

    def _connect(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        db.execute("PRAGMA journal_mode=WAL")
        # The index is derived from the manifests: a last write lost to a power cut is reconciled at open.
        db.execute("PRAGMA synchronous=NORMAL")
        return db

    def _open_db(self) -> tuple[sqlite3.Connection, bool]:
        """The index database, and whether it was made anew (missing, corrupt or of another schema)."""
        if not os.path.exists(self.path):
            log.info("snapshot index missing: building it from the manifests", path=self.path)
            return self._create_db(), True
        db = None
        try:
            db = self._connect()
            if db.execute("PRAGMA quick_check").fetchone()[0] != "ok":
                raise sqlite3.DatabaseError("quick_check failed")
            version = db.execute("PRAGMA user_version").fetchone()[0]
            if version != SCHEMA_VERSION:
                raise sqlite3.DatabaseError(f"schema version {version}, this version uses {SCHEMA_VERSION}")
            return db, False
        except sqlite3.DatabaseError as err:
            log.warning(
                "snapshot index unreadable: rebuilding it from the manifests", path=self.path, error=str(err)
            )
            if db is not None:
                db.close()
            for suffix in ("", "-wal", "-shm"):
                try:
                    os.unlink(self.path + suffix)
                except FileNotFoundError:
                    pass
            return self._create_db(), True

    def _create_db(self) -> sqlite3.Connection:
        db = self._connect()
        db.executescript(_SCHEMA)
        db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
        return db

    def _reconcile(self) -> None:
        """Makes the index match the manifests on disk and sweeps what crashes left behind."""
        indexed = {entry.key: entry for entry in self._select("")}
        on_disk = set(self.store.keys())
        added = updated = 0
        self._db.execute("BEGIN")
        try:
            for key in indexed.keys() - on_disk:
                self._db.execute("DELETE FROM snapshots WHERE key = ?", (key,))
            for key in sorted(on_disk):
                stamp = self.store.manifest_stamp(key)
                entry = indexed.get(key)
                generation = entry.generation if entry is not None else None
                if stamp is not None and (entry is None or entry.manifest_stamp != stamp):
                    try:
                        manifest = self.store.read_manifest(key)
                    except CorruptSnapshot as err:  # aside for inspection, out of the index and budget
                        set_aside(self.store, key, entry, str(err))
                        self._db.execute("DELETE FROM snapshots WHERE key = ?", (key,))
                        continue
                    last_used = max(manifest.created_unix_ns, entry.last_used_ns if entry is not None else 0)
                    self._upsert(manifest, stamp, last_used)
                    added += entry is None
                    updated += entry is not None
                    generation = manifest.generation
                elif stamp is None and entry is not None:
                    self._db.execute("DELETE FROM snapshots WHERE key = ?", (key,))
                removed = self.store.sweep(key, generation if stamp is not None else None)
                if removed:
                    log.info("swept leftovers of an interrupted write", key=key, files=removed)
            self._db.execute("COMMIT")
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        if added or updated or len(indexed.keys() - on_disk):
            log.info(
                "snapshot index reconciled",
                added=added,
                updated=updated,
                dropped=len(indexed.keys() - on_disk),
            )

    # -- rows -----------------------------------------------------------------------------------------

    def _select(self, where: str, params: Sequence = ()) -> list[IndexEntry]:
        rows = self._db.execute(f"SELECT {', '.join(_COLUMNS)} FROM snapshots {where}", params).fetchall()
        return [_entry(row) for row in rows]

    def _get(self, key: str) -> IndexEntry | None:
        found = self._select("WHERE key = ?", (key,))
        return found[0] if found else None

    def _tick(self) -> int:
        """Now, in unix ns, strictly after every earlier use: ties in the LRU order cannot happen."""
        self._clock_ns = max(time.time_ns(), self._clock_ns + 1)
        return self._clock_ns

    def _upsert(self, manifest: Manifest, stamp: str, last_used_ns: int) -> None:
        self._db.execute(
            f"INSERT OR REPLACE INTO snapshots ({', '.join(_COLUMNS)}) "
            f"VALUES ({', '.join('?' * len(_COLUMNS))})",
            (
                manifest.key,
                manifest.tenant,
                manifest.conversation_id,
                manifest.size_bytes,
                last_used_ns,
                int(manifest.pinned),
                len(manifest.token_ids),
                manifest.model_fingerprint,
                manifest.created_unix_ns,
                manifest.generation,
                stamp,
                0,  # a new snapshot: the only copy of what its conversation held when parked
            ),
        )

    def _owned(self, tenant: str, conversation_id: str) -> IndexEntry:
        """The tenant's snapshot of the conversation; the same NOT_FOUND whether another tenant has one."""
        entry = self._get(snapshot_key(tenant, conversation_id))
        if entry is None or entry.tenant != tenant or entry.conversation_id != conversation_id:
            raise SnapshotNotFound(f"no snapshot of conversation {conversation_id!r} for tenant {tenant!r}")
        return entry

    # -- budget ---------------------------------------------------------------------------------------

    def _victims(self, manifest: Manifest) -> list[IndexEntry]:
        """The tenant's unpinned snapshots to evict so that `manifest` fits its tenant's budget and the global
        one (budget.py), the restored ones (spare copies) first, then the least recently used; OverBudget when
        it cannot."""
        key, tenant = manifest.key, manifest.tenant
        own = self._select(
            "WHERE tenant = ? AND key != ? ORDER BY restored DESC, last_used_ns, key", (tenant, key)
        )
        others = self._db.execute(
            "SELECT COALESCE(SUM(size_bytes), 0) FROM snapshots WHERE tenant != ? AND key != ?", (tenant, key)
        ).fetchone()[0]
        held = [Held(entry.key, entry.size_bytes, entry.pinned) for entry in own]
        chosen = {h.key for h in choose_victims(held, others, manifest.size_bytes, *self._budgets)}
        return [entry for entry in own if entry.key in chosen]

    # -- operations -----------------------------------------------------------------------------------

    def begin_put(self, manifest: Manifest) -> PendingSnapshot:
        """Starts a put, refused up front (OverBudget) when it could never fit; nothing is evicted yet."""
        with self._lock:
            self._victims(manifest)
        return self.store.begin_put(manifest)

    def commit_put(self, pending: PendingSnapshot) -> tuple[Manifest, list[IndexEntry]]:
        """Publishes the put, then evicts least recently used unpinned snapshots until the budget holds.

        Returns the stored manifest and the evicted entries. On OverBudget nothing changes.
        """
        with self._lock:
            key = pending.manifest.key
            victims = self._victims(pending.manifest)
            manifest = pending.commit()
            stamp = self.store.manifest_stamp(key)
            assert stamp is not None, f"snapshot {key}: its manifest is gone right after the commit"
            self._upsert(manifest, stamp, self._tick())
            for victim in victims:
                self.store.delete(victim.key)
                self._db.execute("DELETE FROM snapshots WHERE key = ?", (victim.key,))
                log.info(
                    "snapshot evicted", key=victim.key, tenant=victim.tenant, size_bytes=victim.size_bytes
                )
        return manifest, victims

    def put(self, manifest: Manifest, shards: Sequence[bytes]) -> tuple[Manifest, list[IndexEntry]]:
        """A whole put at once (streaming: begin_put, PendingSnapshot.write, commit_put)."""
        pending = self.begin_put(manifest)
        try:
            for index, data in enumerate(shards):
                pending.write(index, data)
            return self.commit_put(pending)
        finally:
            pending.abort()

    def open_for_read(
        self,
        tenant: str,
        conversation_id: str,
        layers: tuple[int, int | None] | None = None,
        model_fingerprint: str | None = None,
    ) -> tuple[Manifest, list[ShardReader]]:
        """Opens the shards covering `layers` [a, b) (all when None; b None: to the last layer) of the
        tenant's snapshot, and marks it used and restored (evicted first from now on: a restore mounts it back
        into a KV pool, where its conversation lives on until it is parked again, a newer put).

        SnapshotNotFound, CorruptSnapshot (manifest or a missing blob), ModelMismatch, LayerRangeError.
        The readers check each blob as it is read; close them when done.
        """
        with self._lock:
            entry = self._owned(tenant, conversation_id)
            try:
                manifest = self.store.read_manifest(entry.key)
            except SnapshotNotFound:
                raise SnapshotNotFound(
                    f"no snapshot of conversation {conversation_id!r} for tenant {tenant!r}"
                ) from None
            if model_fingerprint is not None and model_fingerprint != manifest.model_fingerprint:
                raise ModelMismatch(
                    f"snapshot of another model: {manifest.describe()} was taken with model fingerprint "
                    f"{manifest.model_fingerprint!r}, the restore names {model_fingerprint!r}"
                )
            layer_begin, layer_end = layers or (0, None)
            indices = manifest.shards_covering(
                layer_begin, manifest.num_layers if layer_end is None else layer_end
            )
            readers = self.store.open_shards(manifest, indices)
            self._db.execute(
                "UPDATE snapshots SET last_used_ns = ?, restored = 1 WHERE key = ?", (self._tick(), entry.key)
            )
        return manifest, readers

    def read(
        self,
        tenant: str,
        conversation_id: str,
        layers: tuple[int, int | None] | None = None,
        model_fingerprint: str | None = None,
    ) -> tuple[Manifest, list[bytes]]:
        """The manifest and the checked blobs of the shards covering `layers`, in shard order."""
        manifest, readers = self.open_for_read(tenant, conversation_id, layers, model_fingerprint)
        try:
            return manifest, [reader.read() for reader in readers]
        finally:
            for reader in readers:
                reader.close()

    def list(self, tenant: str, conversation_id: str | None = None) -> list[IndexEntry]:
        """The tenant's snapshots, most recently used first; with a conversation id, SnapshotNotFound
        when the tenant has none of it."""
        with self._lock:
            if conversation_id is not None:
                return [self._owned(tenant, conversation_id)]
            return self._select("WHERE tenant = ? ORDER BY last_used_ns DESC", (tenant,))

    def delete(self, tenant: str, conversation_id: str) -> IndexEntry:
        with self._lock:
            entry = self._owned(tenant, conversation_id)
            self.store.delete(entry.key)
            self._db.execute("DELETE FROM snapshots WHERE key = ?", (entry.key,))
        return entry

    def quarantine(self, key: str, reason: str, generation: str | None = None) -> None:
        """A snapshot that failed its checks: out of the index and the budget, aside (quarantine.py)."""
        with self._lock:
            if set_aside(self.store, key, self._get(key), reason, generation):
                self._db.execute("DELETE FROM snapshots WHERE key = ?", (key,))

    def stat(self, tenant: str, *, scoped: bool = False) -> CacheStat:
        """The whole cache's numbers and the tenant's share; `scoped` (a tenant's own key asks): the
        tenant's numbers only, with its own budget, so that no tenant learns what others hold."""
        where, params = ("WHERE tenant = ?", (tenant,)) if scoped else ("", ())
        budget = min(self.tenant_budget_bytes or self.budget_bytes, self.budget_bytes) if scoped else None
        with self._lock:
            count, size, pinned = self._db.execute(
                "SELECT COUNT(*), COALESCE(SUM(size_bytes), 0), COALESCE(SUM(size_bytes * pinned), 0) "
                f"FROM snapshots {where}",
                params,
            ).fetchone()
            tenant_count, tenant_size = self._db.execute(
                "SELECT COUNT(*), COALESCE(SUM(size_bytes), 0) FROM snapshots WHERE tenant = ?", (tenant,)
            ).fetchone()
        return CacheStat(count, size, budget or self.budget_bytes, pinned, tenant_count, tenant_size)

    def close(self) -> None:
        with self._lock:
            self._db.close()
