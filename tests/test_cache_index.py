"""The SQLite index: LRU eviction by bytes, pins, tenants, and rebuilding from the manifests on disk."""

from __future__ import annotations

import dataclasses
import os
import sqlite3

import pytest

from cache_svc.budget import OverBudget
from cache_svc.index import INDEX_NAME, SnapshotIndex
from cache_svc.manifest import CorruptSnapshot, LayerRangeError, ModelMismatch, SnapshotNotFound, snapshot_key
from cache_svc.quarantine import quarantined
from cache_svc.store import MANIFEST_NAME
from tests.test_cache_store import blobs_for, make_manifest


def put(index: SnapshotIndex, conversation_id: str, size: int, *, tenant="default", pinned=False, seed=0):
    manifest = make_manifest(conversation_id, (size,), tenant=tenant, pinned=pinned, layers_per_shard=6)
    return index.put(manifest, blobs_for(manifest, seed))


def listed(index: SnapshotIndex, tenant="default") -> list[str]:
    return sorted(entry.conversation_id for entry in index.list(tenant))


@pytest.fixture
def index(tmp_path):
    opened = SnapshotIndex(str(tmp_path), budget_bytes=1000)
    yield opened
    opened.close()


def test_puts_past_the_budget_evict_the_least_recently_used(index):
    for name in "abc":
        put(index, name, 300)
    put(index, "a", 300)  # parked again: a is now the most recently used
    _, evicted = put(index, "d", 300)
    assert [e.conversation_id for e in evicted] == ["b"]
    assert listed(index) == ["a", "c", "d"]
    # By bytes: 700 more needs two of the three 300s gone, least recently used first (c, then a).
    _, evicted = put(index, "big", 700)
    assert [e.conversation_id for e in evicted] == ["c", "a"]
    assert listed(index) == ["big", "d"]
    assert index.stat("default").size_bytes == 1000
    on_disk = [k for k in index.store.keys() if index.store.manifest_stamp(k)]
    assert on_disk == sorted(snapshot_key("default", n) for n in ("big", "d"))


def test_restored_snapshots_are_evicted_before_the_only_copies_of_parked_conversations(index):
    """Park a, park b, resume b (its pages back in the pool: its snapshot a spare copy), park c: c's put evicts
    b's spare, not a's only copy, though a was used longest ago. Parking b again makes its snapshot the only
    copy once more."""
    for name in "ab":
        put(index, name, 400)
    index.read("default", "b")
    assert [e.restored for e in index.list("default")] == [True, False]  # b (most recently used), a
    _, evicted = put(index, "c", 400)
    assert [e.conversation_id for e in evicted] == ["b"]
    index.read("default", "c")
    put(index, "c", 400)  # parked again: the only copy
    _, evicted = put(index, "d", 300)
    assert [e.conversation_id for e in evicted] == ["a"] and listed(index) == ["c", "d"]


def test_list_is_most_recently_used_first(index):
    for name in "abc":
        put(index, name, 10)
    index.read("default", "b")
    assert [e.conversation_id for e in index.list("default")] == ["b", "c", "a"]


def test_replacing_a_snapshot_counts_only_the_newer(index):
    put(index, "a", 600)
    put(index, "b", 300)
    _, evicted = put(index, "a", 700)  # 700 + 300 fits once the older a is gone
    assert evicted == []
    assert index.stat("default").size_bytes == 1000
    assert index.read("default", "a")[1] == blobs_for(make_manifest("a", (700,), layers_per_shard=6))


def test_pinned_snapshots_are_never_evicted(index):
    put(index, "pinned", 500, pinned=True)
    put(index, "a", 300)
    _, evicted = put(index, "b", 400)
    assert [e.conversation_id for e in evicted] == ["a"]
    with pytest.raises(OverBudget, match="pinned snapshots hold 500 bytes"):
        put(index, "c", 600)
    assert listed(index) == ["b", "pinned"]  # the refused put evicted nothing
    stat = index.stat("default")
    assert (stat.count, stat.size_bytes, stat.pinned_bytes) == (2, 900, 500)


def test_a_snapshot_bigger_than_the_budget_is_refused_before_it_is_written(index):
    put(index, "a", 300)
    manifest = make_manifest("huge", (1001,), layers_per_shard=6)
    with pytest.raises(OverBudget, match="exceeds the cache budget of 1000 bytes"):
        index.begin_put(manifest)
    assert listed(index) == ["a"]
    assert not os.path.exists(index.store.snapshot_dir(manifest.key))


def test_tenants_see_only_their_own(index):
    put(index, "shared-name", 100, tenant="alice", seed=1)
    put(index, "shared-name", 200, tenant="bob", seed=2)
    put(index, "alice-only", 100, tenant="alice")
    assert listed(index, "alice") == ["alice-only", "shared-name"]
    assert listed(index, "bob") == ["shared-name"]
    assert listed(index, "mallory") == []
    bob_blobs = blobs_for(make_manifest("shared-name", (200,), tenant="bob", layers_per_shard=6), 2)
    assert index.read("bob", "shared-name")[1] == bob_blobs
    for call in (index.read, index.delete, index.list):
        with pytest.raises(
            SnapshotNotFound, match="no snapshot of conversation 'alice-only' for tenant 'bob'"
        ):
            call("bob", "alice-only")
    assert listed(index, "alice") == ["alice-only", "shared-name"]
    index.delete("alice", "shared-name")
    assert index.read("bob", "shared-name")[1] == bob_blobs
    stat = index.stat("bob")
    assert (stat.count, stat.size_bytes, stat.tenant_count, stat.tenant_size_bytes) == (2, 300, 1, 200)


def test_restores_check_the_model_and_the_layer_range(index):
    put(index, "a", 100)
    with pytest.raises(ModelMismatch, match="snapshot of another model"):
        index.read("default", "a", model_fingerprint="model-b")
    with pytest.raises(LayerRangeError):
        index.read("default", "a", layers=(0, 7))
    assert index.read("default", "a", layers=(3, None), model_fingerprint="model-a")[1] == blobs_for(
        make_manifest("a", (100,), layers_per_shard=6)
    )


def entries(index: SnapshotIndex) -> list:
    return sorted(
        (
            dataclasses.replace(e, last_used_ns=0, manifest_stamp="", restored=False)
            for t in ("alice", "bob")
            for e in index.list(t)
        ),
        key=lambda e: e.key,
    )


def fill(index: SnapshotIndex) -> None:
    put(index, "a", 100, tenant="alice")
    put(index, "b", 200, tenant="alice", pinned=True)
    put(index, "c", 300, tenant="bob")


@pytest.mark.parametrize("damage", ["delete", "garbage", "wrong-schema"])
def test_a_lost_or_corrupt_index_is_rebuilt_from_the_manifests(tmp_path, damage):
    index = SnapshotIndex(str(tmp_path), budget_bytes=1000)
    fill(index)
    index.read("alice", "a")  # most recently used
    before = entries(index)
    index.close()
    path = os.path.join(tmp_path, INDEX_NAME)
    if damage == "delete":
        os.unlink(path)
    elif damage == "garbage":
        with open(path, "r+b") as f:
            f.write(b"this is not a database" * 10)
    else:
        db = sqlite3.connect(path)
        db.execute("PRAGMA user_version=99")
        db.commit()
        db.close()

    reopened = SnapshotIndex(str(tmp_path), budget_bytes=1000)
    try:
        assert reopened.rebuilt
        assert entries(reopened) == before
        assert reopened.read("bob", "c")[1] == blobs_for(
            make_manifest("c", (300,), tenant="bob", layers_per_shard=6)
        )
        # Last use after a rebuild is the put time (a's read is forgotten): b, put after a, is newer.
        assert [e.conversation_id for e in reopened.list("alice")] == ["b", "a"]
        # A put evicts its own tenant's snapshots only: alice's a, the least recently used, stays.
        _, evicted = put(reopened, "d", 600, tenant="bob")
        assert [e.conversation_id for e in evicted] == ["c"]
    finally:
        reopened.close()


def test_a_kept_index_keeps_last_use_across_a_restart(tmp_path):
    index = SnapshotIndex(str(tmp_path), budget_bytes=1000)
    fill(index)
    index.read("alice", "a")
    index.close()
    reopened = SnapshotIndex(str(tmp_path), budget_bytes=1000)
    try:
        assert not reopened.rebuilt
        _, evicted = put(reopened, "d", 600, tenant="bob")
        assert [e.conversation_id for e in evicted] == ["c"]  # a was used after c was put
    finally:
        reopened.close()


def test_the_index_is_reconciled_with_changes_behind_its_back(tmp_path):
    index = SnapshotIndex(str(tmp_path), budget_bytes=10_000)
    fill(index)
    index.close()
    # While the index is closed: a's snapshot is replaced (as by a crash after the manifest's rename and
    # before the index's update), b's manifest disappears, c's is corrupted, and a temp file is left over.
    store = index.store
    store.put(
        make_manifest("a", (999,), tenant="alice", layers_per_shard=6),
        blobs_for(make_manifest("a", (999,), tenant="alice", layers_per_shard=6)),
    )
    os.unlink(os.path.join(store.snapshot_dir(snapshot_key("alice", "b")), MANIFEST_NAME))
    c_manifest = os.path.join(store.snapshot_dir(snapshot_key("bob", "c")), MANIFEST_NAME)
    with open(c_manifest, "wb") as f:
        f.write(b"{")
    stray = os.path.join(store.snapshot_dir(snapshot_key("alice", "a")), "0123-0-6.blob.tmp")
    open(stray, "wb").close()

    reopened = SnapshotIndex(str(tmp_path), budget_bytes=10_000)
    try:
        assert not reopened.rebuilt
        assert [(e.conversation_id, e.size_bytes) for e in reopened.list("alice")] == [("a", 999)]
        assert reopened.list("bob") == []
        assert not os.path.exists(stray)
        assert not os.path.exists(store.snapshot_dir(snapshot_key("alice", "b")))  # swept whole
        assert not os.path.exists(c_manifest)  # set aside for inspection, out of the index
        [aside] = quarantined(store, "bob")
        assert aside.conversation_id == "c" and "manifest unreadable" in aside.reason
        assert os.path.exists(os.path.join(aside.path, MANIFEST_NAME))
        with pytest.raises(SnapshotNotFound):
            reopened.read("bob", "c")
    finally:
        reopened.close()


def test_a_corrupt_blob_is_reported_through_the_index(index):
    stored, _ = put(index, "a", 100)
    path = os.path.join(index.store.snapshot_dir(stored.key), stored.shards[0].blob)
    with open(path, "r+b") as f:
        f.write(b"\x00\x01\x02")
    with pytest.raises(CorruptSnapshot, match="checksum mismatch"):
        index.read("default", "a")


def test_one_tenants_parks_never_evict_another_tenants_snapshots(tmp_path):
    index = SnapshotIndex(str(tmp_path), budget_bytes=1000, tenant_budget_bytes=400)
    try:
        put(index, "a1", 200, tenant="alice")
        put(index, "a2", 200, tenant="alice")
        for n in range(4):  # bob parks and parks again: his own oldest go, alice's stay
            _, evicted = put(index, f"b{n}", 150, tenant="bob")
            assert all(e.tenant == "bob" for e in evicted)
        assert listed(index, "alice") == ["a1", "a2"] and listed(index, "bob") == ["b2", "b3"]
        with pytest.raises(OverBudget, match="exceeds the tenant's budget of 400 bytes"):
            put(index, "huge", 500, tenant="bob")
        _, evicted = put(index, "a3", 300, tenant="alice")  # alice's own budget: her oldest two go
        assert [e.conversation_id for e in evicted] == ["a1", "a2"]
        mine = index.stat("bob", scoped=True)
        assert (mine.count, mine.size_bytes, mine.budget_bytes) == (2, 300, 400)
        assert index.stat("bob").count == 3  # the operator's view: everyone's
    finally:
        index.close()


def test_the_global_budget_stays_a_ceiling_over_the_tenants_budgets(tmp_path):
    index = SnapshotIndex(str(tmp_path), budget_bytes=500, tenant_budget_bytes=400)
    try:
        put(index, "a1", 400, tenant="alice")
        with pytest.raises(OverBudget, match="held by other tenants"):
            put(index, "b1", 200, tenant="bob")  # fits bob's budget, not the ceiling: alice's stays
        assert listed(index, "alice") == ["a1"] and listed(index, "bob") == []
    finally:
        index.close()
