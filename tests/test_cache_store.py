"""The snapshot store on a real temp dir: round trips, corruption, crashes mid-write, reads by layer range."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from cache_svc.manifest import (
    Checkpoint,
    CorruptSnapshot,
    InvalidSnapshot,
    LayerRangeError,
    Manifest,
    Shard,
    SnapshotNotFound,
    snapshot_key,
    token_key,
)
from cache_svc.store import MANIFEST_NAME, PendingSnapshot, SnapshotStore

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def make_manifest(
    conversation_id="conv",
    sizes=(1000, 0, 3000),
    *,
    tenant="default",
    tokens=40,
    layers_per_shard=2,
    pinned=False,
) -> Manifest:
    return Manifest(
        tenant=tenant,
        conversation_id=conversation_id,
        token_ids=tuple(range(100, 100 + tokens)),
        checkpoints=(Checkpoint(16, pinned), Checkpoint(tokens)),
        model_fingerprint="model-a",
        num_layers=layers_per_shard * len(sizes),
        page_size=16,
        dtype="float32",
        shards=tuple(
            Shard(i * layers_per_shard, (i + 1) * layers_per_shard, size) for i, size in enumerate(sizes)
        ),
        attributes={"kv_heads": "3"},
    )


def blobs_for(manifest: Manifest, seed: int = 0) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, shard.size_bytes, dtype=np.uint8).tobytes() for shard in manifest.shards]


def files_of(store: SnapshotStore, key: str) -> list[str]:
    return sorted(os.listdir(store.snapshot_dir(key)))


def test_keys_are_stable_across_processes_and_versions():
    # Fixed values: a change of either function orphans every snapshot on disk.
    assert snapshot_key("default", "conv") == (
        "1dac5a51817a370430fcef5f0d8dd1a8bcbf4999241a32479a02859ac41bbebe"
    )
    assert snapshot_key("ab", "c") != snapshot_key("a", "bc")  # length-prefixed: no ambiguity
    tokens = [1, 2, 70000, 2**31 - 1]
    assert token_key(tokens) == hashlib.sha256(np.array(tokens, dtype="<i4").tobytes()).hexdigest()
    assert token_key(np.array(tokens, dtype=np.int64)) == token_key(tokens)
    assert token_key([1, 2, 3]) == "4636993d3e1da4e9d6b8f87b79e8f7c6d018580d52661950eabc3845c5897a4d"


def test_round_trip_is_byte_for_byte(tmp_path):
    store = SnapshotStore(str(tmp_path))
    manifest = make_manifest()
    blobs = blobs_for(manifest)
    stored = store.put(manifest, blobs)
    assert stored.generation and stored.created_unix_ns > 0
    assert all(s.sha256 == hashlib.sha256(b).hexdigest() for s, b in zip(stored.shards, blobs))

    read_manifest, read_blobs = SnapshotStore(str(tmp_path)).read(manifest.key)
    assert read_blobs == blobs
    assert read_manifest == stored
    assert (
        dataclasses.replace(read_manifest, shards=manifest.shards, created_unix_ns=0, generation="")
        == manifest
    )
    assert files_of(store, manifest.key) == sorted([MANIFEST_NAME] + [s.blob for s in stored.shards])


def test_checkpoint_flags_round_trip_and_an_older_manifest_keeps_its_roots(tmp_path):
    store = SnapshotStore(str(tmp_path))
    manifest = dataclasses.replace(
        make_manifest(), checkpoints=(Checkpoint(8, root=True), Checkpoint(16, pinned=True), Checkpoint(40))
    )
    store.put(manifest, blobs_for(manifest))
    assert store.read_manifest(manifest.key).checkpoints == manifest.checkpoints

    # A manifest written before Checkpoint had `root`: no flag, the roots in the executor's attribute.
    path = os.path.join(store.snapshot_dir(manifest.key), MANIFEST_NAME)
    with open(path, "rb") as f:
        fields = json.load(f)
    for checkpoint in fields["checkpoints"]:
        del checkpoint["root"]
    fields["attributes"]["root_positions"] = "8"
    with open(path, "w") as f:
        json.dump(fields, f)
    older = store.read_manifest(manifest.key)
    assert older.checkpoints == manifest.checkpoints
    assert older.attributes == manifest.attributes


def test_a_newer_put_replaces_the_older_and_removes_its_blobs(tmp_path):
    store = SnapshotStore(str(tmp_path))
    old = store.put(make_manifest(sizes=(10, 20)), blobs_for(make_manifest(sizes=(10, 20))))
    newer_manifest = make_manifest(sizes=(30, 40, 50), tokens=60)
    newer_blobs = blobs_for(newer_manifest, seed=1)
    newer = store.put(newer_manifest, newer_blobs)
    assert newer.key == old.key
    manifest, blobs = store.read(old.key)
    assert blobs == newer_blobs and len(manifest.token_ids) == 60
    assert files_of(store, old.key) == sorted([MANIFEST_NAME] + [s.blob for s in newer.shards])


@pytest.mark.parametrize("damage", ["flip", "truncate", "extend", "remove"])
def test_a_damaged_blob_is_refused_naming_the_snapshot_and_shard(tmp_path, damage):
    store = SnapshotStore(str(tmp_path))
    stored = store.put(make_manifest(), blobs_for(make_manifest()))
    path = os.path.join(store.snapshot_dir(stored.key), stored.shards[2].blob)
    data = bytearray(open(path, "rb").read())
    if damage == "flip":
        data[1234] ^= 0x01
    elif damage == "truncate":
        data = data[:-1]
    elif damage == "extend":
        data += b"\0"
    if damage == "remove":
        os.unlink(path)
    else:
        with open(path, "wb") as f:
            f.write(data)
    with pytest.raises(CorruptSnapshot) as refused:
        store.read(stored.key)
    assert refused.value.shard == 2 and refused.value.key == stored.key
    message = str(refused.value)
    assert stored.key[:12] in message and "'conv'" in message and "shard 2 (layers [4, 6))" in message
    # The shards before it still read.
    assert store.read(stored.key, (0, 4))[1] == blobs_for(make_manifest())[:2]


def test_a_corrupt_manifest_is_refused(tmp_path):
    store = SnapshotStore(str(tmp_path))
    stored = store.put(make_manifest(), blobs_for(make_manifest()))
    path = os.path.join(store.snapshot_dir(stored.key), MANIFEST_NAME)
    with open(path, "r+b") as f:
        f.truncate(100)
    with pytest.raises(CorruptSnapshot, match="manifest unreadable"):
        store.read(stored.key)


def test_a_layer_range_reads_only_the_shards_that_cover_it(tmp_path):
    store = SnapshotStore(str(tmp_path))
    manifest = make_manifest(sizes=(100, 200, 300, 400))  # layers [0,2) [2,4) [4,6) [6,8)
    blobs = blobs_for(manifest)
    stored = store.put(manifest, blobs)
    directory = store.snapshot_dir(stored.key)
    with open(os.path.join(directory, stored.shards[0].blob), "r+b") as f:
        f.write(b"\xff\xff")  # shard 0 corrupt
    os.unlink(os.path.join(directory, stored.shards[3].blob))  # shard 3 gone

    for layers, expected in (((2, 4), [1]), ((3, 5), [1, 2]), ((2, 6), [1, 2]), ((5, 6), [2])):
        read_manifest, read_blobs = store.read(stored.key, layers)
        assert read_manifest.shards_covering(*layers) == expected
        assert read_blobs == [blobs[i] for i in expected]
    with pytest.raises(CorruptSnapshot):
        store.read(stored.key, (1, 3))
    with pytest.raises(CorruptSnapshot, match="missing"):
        store.read(stored.key, (7, 8))


@pytest.mark.parametrize("layers", [(0, 9), (-1, 2), (3, 3), (8, 10)])
def test_a_layer_range_the_snapshot_lacks_is_refused(tmp_path, layers):
    store = SnapshotStore(str(tmp_path))
    stored = store.put(make_manifest(), blobs_for(make_manifest()))
    with pytest.raises(LayerRangeError, match=r"has layers \[0, 6\); cannot restore"):
        store.read(stored.key, layers)


def test_unknown_snapshot_is_not_found(tmp_path):
    with pytest.raises(SnapshotNotFound):
        SnapshotStore(str(tmp_path)).read(snapshot_key("default", "nobody"))


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(conversation_id=""), "conversation_id must be a non-empty string"),
        (dict(tenant=""), "tenant must be a non-empty string"),
        (dict(token_ids=()), "token_ids is empty"),
        (dict(token_ids=(1, -2)), "negative id"),
        (dict(checkpoints=(Checkpoint(20), Checkpoint(10))), "strictly increasing"),
        (dict(checkpoints=(Checkpoint(41),)), r"in \[1, 40\]"),
        (dict(model_fingerprint=""), "model_fingerprint"),
        (dict(num_layers=0), "num_layers must be an integer >= 1"),
        (dict(page_size=0), "page_size"),
        (dict(shards=()), "at least one shard"),
        (dict(shards=(Shard(0, 2, 1), Shard(3, 6, 1))), "should start at layer 2"),
        (dict(shards=(Shard(0, 2, 1), Shard(2, 4, 1))), "shards end at layer 4; num_layers is 6"),
        (dict(shards=(Shard(0, 6, -1),)), "size_bytes must be an integer >= 0"),
        (dict(shards=(Shard(0, 6, 1, "XYZ"),)), "sha256 must be 64 lowercase hex"),
    ],
)
def test_malformed_manifests_say_what_is_wrong(change, message):
    with pytest.raises(InvalidSnapshot, match=message):
        dataclasses.replace(make_manifest(), **change)


def leftover_files(store: SnapshotStore) -> list[str]:
    return sorted(
        os.path.join(key, name) for key in store.keys() for name in os.listdir(store.snapshot_dir(key))
    )


@pytest.mark.parametrize(
    "mistake, message",
    [
        (lambda p: p.write(5, b"x"), "the header declares 3 shards"),
        (
            lambda p: (p.write(0, b"x" * 1000), p.write(2, b"x"), p.write(0, b"x")),
            "chunks come in shard order",
        ),
        (lambda p: p.write(0, b"x" * 1001), "more than the 1000 bytes"),
        (lambda p: (p.write(0, b"x" * 1000), p.commit()), "shard 2 .*received 0 bytes, the header says 3000"),
        (lambda p: (p.write(0, b"x" * 999), p.write(2, b"x")), "shard 0 .*received 999 bytes"),
    ],
)
def test_a_bad_stream_is_refused_and_changes_nothing(tmp_path, mistake, message):
    store = SnapshotStore(str(tmp_path))
    manifest = make_manifest()
    old_blobs = blobs_for(manifest, seed=7)
    store.put(manifest, old_blobs)
    before = leftover_files(store)
    pending = store.begin_put(manifest)
    with pytest.raises(InvalidSnapshot, match=message):
        mistake(pending)
    pending.abort()
    assert leftover_files(store) == before
    assert store.read(manifest.key)[1] == old_blobs


def test_a_declared_checksum_is_checked_on_the_way_in(tmp_path):
    store = SnapshotStore(str(tmp_path))
    manifest = make_manifest(sizes=(4,), layers_per_shard=6)
    declared = dataclasses.replace(manifest, shards=(Shard(0, 6, 4, hashlib.sha256(b"abcd").hexdigest()),))
    store.put(declared, [b"abcd"])
    with pytest.raises(InvalidSnapshot, match="received bytes have sha256"):
        store.put(declared, [b"abce"])
    assert store.read(manifest.key)[1] == [b"abcd"]


def test_an_exception_between_blobs_and_manifest_leaves_the_previous_snapshot(tmp_path, monkeypatch):
    store = SnapshotStore(str(tmp_path))
    manifest = make_manifest()
    old_blobs = blobs_for(manifest)
    old = store.put(manifest, old_blobs)

    def crash(self, stored):
        raise OSError("disk on fire")

    monkeypatch.setattr(PendingSnapshot, "_publish_manifest", crash)
    with pytest.raises(OSError, match="disk on fire"):
        store.put(make_manifest(tokens=50), blobs_for(manifest, seed=3))
    read_manifest, blobs = store.read(old.key)
    assert read_manifest == old and blobs == old_blobs
    # abort took its published-but-unreferenced blobs back
    assert files_of(store, old.key) == sorted([MANIFEST_NAME] + [s.blob for s in old.shards])


# A writer process: stores a first snapshot, then starts a second and is SIGKILLed during it.
WRITER = textwrap.dedent("""
    import os, sys, time
    sys.path.insert(0, {root!r})
    from cache_svc.store import PendingSnapshot, SnapshotStore
    from tests.test_cache_store import blobs_for, make_manifest

    store = SnapshotStore({dir!r})
    manifest = make_manifest(sizes=(1 << 20, 1 << 20, 1 << 20))
    if {first!r}:
        store.put(manifest, blobs_for(manifest, seed=1))
    newer = make_manifest(sizes=(1 << 20, 1 << 20, 1 << 20), tokens=60)
    pending = store.begin_put(newer)
    blobs = blobs_for(newer, seed=2)
    if {where!r} == "mid-blob":
        pending.write(0, blobs[0])
        pending.write(1, blobs[1][: 1 << 19])
    else:  # between the blobs' renames and the manifest's
        def killed(self, stored):
            print("published blobs", flush=True)
            time.sleep(60)
        PendingSnapshot._publish_manifest = killed
        for index, blob in enumerate(blobs):
            pending.write(index, blob)
        pending.commit()
    print("wrote part", flush=True)
    time.sleep(60)
""")


@pytest.mark.parametrize("where", ["mid-blob", "before-manifest"])
@pytest.mark.parametrize("first", [True, False])
def test_a_writer_killed_mid_write_leaves_the_previous_snapshot_intact(tmp_path, where, first):
    script = WRITER.format(root=ROOT, dir=str(tmp_path), first=first, where=where)
    writer = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        line = writer.stdout.readline()
        assert line.strip() in ("wrote part", "published blobs"), f"the writer died early: {line!r}"
        os.kill(writer.pid, signal.SIGKILL)
    finally:
        writer.wait(10)
    assert writer.returncode == -signal.SIGKILL

    store = SnapshotStore(str(tmp_path))  # as after a restart
    manifest = make_manifest(sizes=(1 << 20, 1 << 20, 1 << 20))
    leftovers = leftover_files(store)
    assert any(name.endswith(".tmp") or name.endswith(".blob") for name in leftovers)
    if not first:
        with pytest.raises(SnapshotNotFound):
            store.read(manifest.key)
        store.sweep(manifest.key, None)
        assert store.keys() == []
        return
    read_manifest, blobs = store.read(manifest.key)
    assert blobs == blobs_for(manifest, seed=1) and len(read_manifest.token_ids) == 40
    removed = store.sweep(manifest.key, read_manifest.generation)
    assert removed and all(not name.startswith(read_manifest.generation) for name in removed)
    assert files_of(store, manifest.key) == sorted([MANIFEST_NAME] + [s.blob for s in read_manifest.shards])
    assert store.read(manifest.key)[1] == blobs_for(manifest, seed=1)


def test_delete_removes_the_manifest_then_the_blobs(tmp_path):
    store = SnapshotStore(str(tmp_path))
    stored = store.put(make_manifest(), blobs_for(make_manifest()))
    assert store.delete(stored.key)
    assert not store.delete(stored.key)
    assert files_of(store, stored.key) == []
    with pytest.raises(SnapshotNotFound):
        store.read(stored.key)
    store.sweep(stored.key, None)
    assert store.keys() == []
