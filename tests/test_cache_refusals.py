"""The cache service over real gRPC on port 0, in-process, refusing: a flipped byte as data loss (the
snapshot quarantined), strings that are not UTF-8, restores of another model or other layers, malformed
puts, puts past the budget (evicting what it can) or a full disk, and a put cancelled midway; none
changes what is stored."""

from __future__ import annotations

import asyncio
import contextlib
import os

import grpc
import pytest

from cache_svc.client import CacheClient, put_parts
from cache_svc.server import SERVICE_NAME, start_cache_server
from protos import cache_pb2, cache_pb2_grpc
from tests.cache_snapshots import MiB, expect_status, snapshot

pytestmark = pytest.mark.asyncio(loop_scope="session")


async def test_a_flipped_byte_is_data_loss_naming_snapshot_and_shard(served):
    _, client, root = served
    manifest, blobs = snapshot()
    reply = await client.put(manifest, blobs)
    directory = os.path.join(root, "snapshots", reply["key"])
    [blob] = [name for name in os.listdir(directory) if name.endswith("-4-6.blob")]
    with open(os.path.join(directory, blob), "r+b") as f:
        f.seek(2000)
        byte = f.read(1)
        f.seek(2000)
        f.write(bytes([byte[0] ^ 0x80]))
    await expect_status(
        client.get("default", "conv"),
        grpc.StatusCode.DATA_LOSS,
        reply["key"][:12],
        "'conv'",
        "shard 2 (layers [4, 6))",
        "checksum mismatch",
    )
    # Quarantined: out of the index and the budget, never offered again, kept aside and listed.
    await expect_status(client.get("default", "conv", layers=(0, 4)), grpc.StatusCode.NOT_FOUND, "'conv'")
    assert not os.path.exists(directory)
    assert await client.list("default") == []
    assert (await client.stat("default"))["size_bytes"] == 0
    [aside] = await client.list("default", include_quarantined=True)
    assert aside["conversation_id"] == "conv" and "checksum mismatch" in aside["quarantined"]
    assert os.path.join(root, "quarantine", reply["key"]) in aside["quarantined"]
    reply = await client.put(manifest, blobs)
    [blob] = [name for name in os.listdir(directory) if name.endswith("-4-6.blob")]
    os.truncate(os.path.join(directory, blob), 10)
    await expect_status(
        client.get("default", "conv", layers=(5, 6)),
        grpc.StatusCode.DATA_LOSS,
        "blob is 10 bytes, the manifest says 3000",
    )


async def test_strings_that_are_not_utf8_are_invalid_argument_naming_the_field(served):
    """Protobuf refuses them while gRPC parses the request, which answered UNKNOWN "Unexpected DecodeError"."""
    server, client, _ = served
    manifest, blobs = snapshot()
    await client.put(manifest, blobs)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        for method in ("Delete", "List", "Get"):
            request = getattr(cache_pb2, f"{method}Request")
            number = request.DESCRIPTOR.fields_by_name["conversation_id"].number
            raw = bytes([number << 3 | 2, 2, 0xFF, 0xFE])  # conversation_id: two bytes, not UTF-8
            call = channel.unary_unary if method != "Get" else channel.unary_stream
            rpc = call(f"/{SERVICE_NAME}/{method}", request_serializer=bytes, response_deserializer=bytes)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await (rpc(raw) if method != "Get" else anext(aiter(rpc(raw))))
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, refused.value.details())
            assert "conversation_id is not valid UTF-8" in refused.value.details(), refused.value.details()
    assert (await client.get("default", "conv"))[1] == blobs  # nothing changed


async def test_restore_refusals(served):
    _, client, _ = served
    await client.put(*snapshot())
    await expect_status(
        client.get("default", "conv", fingerprint="model-b"),
        grpc.StatusCode.FAILED_PRECONDITION,
        "snapshot of another model",
        "'model-a'",
        "'model-b'",
    )
    await expect_status(
        client.get("default", "conv", layers=(4, 9)),
        grpc.StatusCode.OUT_OF_RANGE,
        "has layers [0, 6); cannot restore [4, 9)",
    )
    await expect_status(
        client.get("default", "conv", layers=(3, 3)),
        grpc.StatusCode.INVALID_ARGUMENT,
        "empty or negative layer range",
    )
    await expect_status(
        client.get("default", ""), grpc.StatusCode.INVALID_ARGUMENT, "conversation_id is empty"
    )


async def raw_put(channel_addr: str, parts: list[cache_pb2.SnapshotPart]):
    async with grpc.aio.insecure_channel(channel_addr) as channel:
        return await cache_pb2_grpc.CacheStub(channel).Put(iter(parts))


async def test_malformed_puts_are_invalid_argument_and_change_nothing(served):
    _, client, root = served
    manifest, blobs = snapshot()
    await client.put(manifest, blobs)
    before = sorted(os.listdir(os.path.join(root, "snapshots", (await client.list())[0]["key"])))
    addr = client.addr
    header, *chunks = list(put_parts(manifest, [b"\1" * len(b) for b in blobs]))
    bad_header = cache_pb2.SnapshotPart()
    bad_header.CopyFrom(header)
    bad_header.header.shards[1].layer_begin = 3
    cases = [
        (chunks, "the first message of a Put must be the header"),
        ([], "the header is missing"),
        ([header, header], "one header, then chunks"),
        ([header, *chunks[:-1]], "shard 2 (layers [4, 6)): received 0 bytes, the header says 3000"),
        ([header, chunks[0], chunks[1], chunks[0]], "chunks come in shard order"),
        ([bad_header, *chunks], "should start at layer 2"),
    ]
    for parts, message in cases:
        await expect_status(raw_put(addr, parts), grpc.StatusCode.INVALID_ARGUMENT, message)
    bad_manifest = dict(manifest, checkpoints=[{"position": 99}])
    await expect_status(
        client.put(bad_manifest, blobs), grpc.StatusCode.INVALID_ARGUMENT, "strictly increasing"
    )
    await expect_status(
        client.put(dict(manifest, model_fingerprint=""), blobs),
        grpc.StatusCode.INVALID_ARGUMENT,
        "model_fingerprint must be a non-empty string",
    )
    with_sha = dict(manifest, shards=[dict(s, sha256="0" * 64) for s in manifest["shards"]])
    await expect_status(
        client.put(with_sha, blobs), grpc.StatusCode.INVALID_ARGUMENT, "received bytes have sha256"
    )

    assert sorted(os.listdir(os.path.join(root, "snapshots", (await client.list())[0]["key"]))) == before
    assert (await client.get("default", "conv"))[1] == blobs


async def test_budget_evicts_and_refuses(tmp_path):
    server = await start_cache_server(str(tmp_path), budget_bytes=10_000)
    try:
        async with CacheClient(f"127.0.0.1:{server.port}") as client:
            await client.put(*snapshot("pinned", (2000, 2000), pinned=True))
            await client.put(*snapshot("a", (3000,)))
            assert (await client.put(*snapshot("b", (3000,))))["evicted"] == 0
            assert (await client.put(*snapshot("c", (3000,))))["evicted"] == 1
            assert sorted(i["conversation_id"] for i in await client.list()) == ["b", "c", "pinned"]
            await expect_status(
                client.put(*snapshot("huge", (10_001,))),
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                "exceeds the cache budget of 10000 bytes",
            )
            await expect_status(
                client.put(*snapshot("d", (7000,))),
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                "pinned snapshots hold 4000 bytes",
            )
            assert (await client.stat())["pinned_bytes"] == 4000
    finally:
        await server.stop(None)


async def test_a_put_cancelled_midway_leaves_the_older_snapshot_and_no_temporary_files(served):
    _, client, root = served
    manifest, blobs = snapshot("conv", (3 * MiB, 3 * MiB))
    await client.put(manifest, blobs)
    directory = os.path.join(root, "snapshots", (await client.list())[0]["key"])
    before = sorted(os.listdir(directory))
    header, first_chunk, *_ = put_parts(manifest, [b"\2" * len(b) for b in blobs])
    sent_part = asyncio.Event()

    async def parts_then_stall():
        yield header
        yield first_chunk
        sent_part.set()
        await asyncio.sleep(60)

    async with grpc.aio.insecure_channel(client.addr) as channel:
        call = cache_pb2_grpc.CacheStub(channel).Put(parts_then_stall())
        await sent_part.wait()
        for _ in range(200):  # until the server has the partial blob on disk
            if any(name.endswith(".tmp") for name in os.listdir(directory)):
                break
            await asyncio.sleep(0.01)
        assert any(name.endswith(".tmp") for name in os.listdir(directory))
        call.cancel()
    for _ in range(500):
        if sorted(os.listdir(directory)) == before:
            break
        await asyncio.sleep(0.01)
    assert sorted(os.listdir(directory)) == before
    assert (await client.get("default", "conv"))[1] == blobs


async def test_a_put_over_the_whole_budget_is_resource_exhausted_with_sizes_mid_stream(served):
    # 80 MiB against a 64 MiB budget: refused after the header while chunks are still going out; the
    # client must see the service's status, not INTERNAL "Internal error from Core".
    _, client, _ = served
    manifest, _ = snapshot(sizes=(1000, 0, 3000))
    blobs = [bytes(40 * MiB), b"", bytes(40 * MiB)]
    await expect_status(
        client.put(manifest, blobs),
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        f"a snapshot of {80 * MiB} bytes exceeds the cache budget of {64 * MiB} bytes",
    )
    assert await client.list("default") == []


@pytest.mark.skipif(os.geteuid() != 0, reason="mounts a small tmpfs (root)")
async def test_a_full_disk_is_resource_exhausted_and_the_cache_serves_on(tmp_path):
    """A disk too small for a snapshot: RESOURCE_EXHAUSTED naming the error (was UNKNOWN with a traceback),
    no partial blob left, and what fits is still stored and read back."""
    import subprocess

    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)], capture_output=True
    )
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        server = await start_cache_server(str(disk), budget_bytes=64 * MiB)
        try:
            async with CacheClient(f"127.0.0.1:{server.port}") as client:
                await expect_status(
                    client.put(*snapshot("big", (2 * MiB,))),
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    "could not store the snapshot",
                    "No space left on device",
                )
                leftovers = [p for p in (disk / "snapshots").rglob("*") if p.is_file()]
                assert not leftovers, leftovers
                # A disk with a page left: the shards' buffered bytes fail at close, after the writes.
                filler = disk / "filler"
                with open(filler, "wb", buffering=0) as f, contextlib.suppress(OSError):
                    while True:
                        f.write(b"x" * 4096)
                os.truncate(filler, os.path.getsize(filler) - 4096)
                await expect_status(
                    client.put(*snapshot("small", (1000, 0, 3000))),
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    "could not store",
                )
                leftovers = [p for p in (disk / "snapshots").rglob("*") if p.is_file()]
                assert not leftovers, leftovers
                filler.unlink()
                manifest, blobs = snapshot("small", (1000,))
                await client.put(manifest, blobs)
                assert (await client.get("default", "small"))[1] == blobs
        finally:
            await server.stop(None)
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)
