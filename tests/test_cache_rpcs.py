"""The cache service over real gRPC on port 0, in-process, answering: put, get, list, delete and stat, each
tenant seeing its own, snapshots kept across restarts (a lost index rebuilt), ten MiB in chunks, health
and reflection, and the container health probe."""

from __future__ import annotations

import asyncio
import os
import sys

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from cache_svc import CHUNK_BYTES
from cache_svc.client import CacheClient, put_parts
from cache_svc.server import SERVICE_NAME, start_cache_server
from protos import cache_pb2, cache_pb2_grpc
from tests.cache_snapshots import MiB, expect_status, snapshot

pytestmark = pytest.mark.asyncio(loop_scope="session")


async def test_put_get_list_delete_stat(served):
    _, client, _ = served
    manifest, blobs = snapshot()
    reply = await client.put(manifest, blobs)
    assert reply["size_bytes"] == 4000 and reply["evicted"] == 0 and len(reply["key"]) == 64

    got, got_blobs = await client.get("default", "conv")
    assert got_blobs == blobs
    assert got["key"] == reply["key"] and got["created_unix_ns"] > 0
    assert {k: got[k] for k in manifest if k != "shards"} == {
        k: manifest[k] for k in manifest if k != "shards"
    }
    assert [s["layers"] for s in got["shards"]] == [[0, 2], [2, 4], [4, 6]]
    assert [s["size_bytes"] for s in got["shards"]] == [1000, 0, 3000]

    got, got_blobs = await client.get("default", "conv", layers=(3, 5), fingerprint="model-a")
    assert [s["layers"] for s in got["shards"]] == [[2, 4], [4, 6]] and got_blobs == blobs[1:]

    [info] = await client.list("default")
    assert info["conversation_id"] == "conv" and info["pinned"] is False and info["num_tokens"] == 40
    assert await client.list("default", "conv") == [info | {"last_used_unix_ns": info["last_used_unix_ns"]}]
    stat = await client.stat()
    assert (stat["count"], stat["size_bytes"], stat["budget_bytes"]) == (1, 4000, 64 * MiB)

    assert await client.delete("default", "conv") == {"key": reply["key"], "size_bytes": 4000}
    assert await client.list("default") == []
    await expect_status(client.get("default", "conv"), grpc.StatusCode.NOT_FOUND, "'conv'")
    await expect_status(client.delete("default", "conv"), grpc.StatusCode.NOT_FOUND)
    assert (await client.stat())["count"] == 0


async def test_other_tenants_get_not_found(served):
    _, client, _ = served
    manifest, blobs = snapshot(tenant="alice")
    await client.put(manifest, blobs)
    for call in (
        client.get("bob", "conv"),
        client.delete("bob", "conv"),
        client.list("bob", "conv"),
        client.get("default", "conv"),
    ):
        await expect_status(call, grpc.StatusCode.NOT_FOUND, "no snapshot of conversation 'conv'")
    assert await client.list("bob") == []
    assert len(await client.list("alice")) == 1
    assert (await client.get("alice", "conv"))[1] == blobs
    stat = await client.stat("bob")
    assert (stat["count"], stat["tenant_count"], stat["tenant_size_bytes"]) == (1, 0, 0)


async def test_a_restarted_server_keeps_its_snapshots(tmp_path):
    server = await start_cache_server(str(tmp_path), budget_bytes=64 * MiB)
    stored = {}
    try:
        async with CacheClient(f"127.0.0.1:{server.port}") as client:
            for i, tenant in enumerate(("alice", "bob")):
                manifest, blobs = snapshot(f"conv-{i}", seed=i, tenant=tenant)
                stored[tenant] = (await client.put(manifest, blobs))["key"], blobs
            listed = {t: await client.list(t) for t in stored}
    finally:
        await server.stop(None)
    os.unlink(os.path.join(tmp_path, "index.sqlite3"))  # a lost index as well: rebuilt from the manifests
    for _ in range(2):
        server = await start_cache_server(str(tmp_path), budget_bytes=64 * MiB)
        try:
            async with CacheClient(f"127.0.0.1:{server.port}") as client:
                assert {t: [i["key"] for i in await client.list(t)] for t in stored} == {
                    t: [i["key"] for i in listed[t]] for t in stored
                }
                for i, (tenant, (key, blobs)) in enumerate(stored.items()):
                    got, got_blobs = await client.get(tenant, f"conv-{i}")
                    assert got["key"] == key and got_blobs == blobs
        finally:
            await server.stop(None)


async def test_ten_mib_travel_in_chunks(served):
    _, client, _ = served
    manifest, blobs = snapshot("big", (10 * MiB + 5, 3 * MiB))
    parts = list(put_parts(manifest, blobs))
    sizes = [len(p.chunk.data) for p in parts[1:]]
    assert max(sizes) <= CHUNK_BYTES <= 4 * MiB
    assert len(parts) == 1 + -(-(10 * MiB + 5) // CHUNK_BYTES) + -(-3 * MiB // CHUNK_BYTES)
    await client.put(manifest, blobs)

    # A channel with the default 4 MiB receive limit reads it all, chunk by chunk.
    async with grpc.aio.insecure_channel(client.addr) as channel:
        call = cache_pb2_grpc.CacheStub(channel).Get(cache_pb2.GetRequest(conversation_id="big"))
        received = [part async for part in call]
    assert received[0].WhichOneof("part") == "header"
    assert all(len(p.chunk.data) <= CHUNK_BYTES for p in received[1:])
    assert len(received) == len(parts)
    assert b"".join(p.chunk.data for p in received[1:] if p.chunk.shard == 0) == blobs[0]
    assert (await client.get("default", "big"))[1] == blobs


async def test_health_and_reflection(served):
    _, client, _ = served
    async with grpc.aio.insecure_channel(client.addr) as channel:
        for service in ("", SERVICE_NAME):
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service)
            )
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        call = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")])
        )
        names = [s.name async for reply in call for s in reply.list_services_response.service]
    assert SERVICE_NAME in names
    await client.wait_ready(5)


async def run_health_probe(port: int) -> tuple[int, str]:
    """`python -m deltaserve.health_probe` as a container's health check runs it: the port from the env."""
    probe = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "deltaserve.health_probe",
        env={**os.environ, "DELTASERVE_PORT": str(port)},
        stdout=asyncio.subprocess.PIPE,
    )
    out, _ = await probe.communicate()
    return probe.returncode or 0, out.decode().strip()


async def test_the_health_probe_exits_0_only_while_serving(tmp_path):
    server = await start_cache_server(str(tmp_path), budget_bytes=MiB)
    assert await run_health_probe(server.port) == (0, f"127.0.0.1:{server.port}: SERVING")
    await server.set_serving(False)  # what a draining planner, or one with no executor, says
    assert await run_health_probe(server.port) == (1, f"127.0.0.1:{server.port}: NOT_SERVING")
    await server.stop(None)
    code, said = await run_health_probe(server.port)
    assert code == 1 and "UNAVAILABLE" in said
