"""The cache with API keys, over real gRPC on loopback: the tenant comes from the key, a tenant sees
nothing of another (NOT_FOUND, the same as for a snapshot that does not exist), the service key acts for
the tenant it names, `stat` is scoped, and the per-tenant budget keeps one tenant from evicting another."""

from __future__ import annotations

import grpc
import pytest

from cache_svc.client import CacheClient
from cache_svc.server import start_cache_server
from protos.auth import parse_keys
from protos.rpc import ChannelSecurity, ServerSecurity
from tests.cache_snapshots import expect_status, snapshot

pytestmark = pytest.mark.asyncio(loop_scope="session")

ALICE, BOB, SERVICE = "alice-key-0123456789", "bob-key-0123456789ab", "service-key-0123456789"
KEYS = parse_keys(f"{ALICE} alice\n{BOB} bob\n{SERVICE} *\n")


def client(port: int, key: str | None) -> CacheClient:
    return CacheClient(f"127.0.0.1:{port}", ChannelSecurity(api_key=key))


async def test_tenants_see_nothing_of_each_other_and_the_service_key_names_the_tenant(tmp_path):
    server = await start_cache_server(
        str(tmp_path), 1 << 20, tenant_budget_bytes=10_000, security=ServerSecurity(keys=KEYS)
    )
    alice, bob, service, nobody = (client(server.port, k) for k in (ALICE, BOB, SERVICE, None))
    try:
        await expect_status(nobody.stat(), grpc.StatusCode.UNAUTHENTICATED, "no API key")
        await nobody.wait_ready(5)  # health stays open
        for tenant in ("alice", "bob"):  # as the planner parks for each
            await service.put(*snapshot("conv", (1000, 2000), tenant=tenant))
        for tenant in ("", "bob"):  # a tenant's key puts nothing, for itself or another
            await expect_status(
                alice.put(*snapshot("x", (10,), tenant=tenant)),
                grpc.StatusCode.PERMISSION_DENIED,
                "snapshots are put with the service key",
            )
        assert [s["conversation_id"] for s in await service.list("alice")] == ["conv"]
        assert [s["conversation_id"] for s in await alice.list("")] == ["conv"]
        await expect_status(alice.list("bob"), grpc.StatusCode.PERMISSION_DENIED)
        await expect_status(alice.get("", "other"), grpc.StatusCode.NOT_FOUND)
        header, _ = await service.get("bob", "conv")
        assert header["tenant"] == "bob"
        await alice.delete("", "conv")
        await expect_status(alice.delete("", "conv"), grpc.StatusCode.NOT_FOUND)
        assert [s["conversation_id"] for s in await bob.list("")] == ["conv"]  # bob's is untouched
        mine = await bob.stat("")
        assert (mine["count"], mine["size_bytes"], mine["budget_bytes"]) == (1, 3000, 10_000)
        everyone = await service.stat("bob")
        assert everyone["budget_bytes"] == 1 << 20 and everyone["tenant_count"] == 1
    finally:
        for c in (alice, bob, service, nobody):
            await c.close()
        await server.stop(None)


async def test_one_tenants_parks_never_evict_anothers_snapshots_over_grpc(tmp_path):
    server = await start_cache_server(
        str(tmp_path), 20_000, tenant_budget_bytes=7_000, security=ServerSecurity(keys=KEYS)
    )
    alice, service = client(server.port, ALICE), client(server.port, SERVICE)
    try:
        await service.put(*snapshot("a", (3000, 3000), tenant="alice"))
        evicted = 0
        for n in range(5):
            evicted += (await service.put(*snapshot(f"b{n}", (3000, 3000), tenant="bob")))["evicted"]
        assert evicted == 4  # bob's own older snapshot each time
        assert [s["conversation_id"] for s in await alice.list("")] == ["a"]
        await expect_status(
            service.put(*snapshot("big", (4000, 4000), tenant="bob")),
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "exceeds the tenant's budget of 7000 bytes",
        )
    finally:
        await alice.close()
        await service.close()
        await server.stop(None)


async def test_a_large_put_with_an_unknown_key_is_unauthenticated_not_a_broken_connection(tmp_path):
    """The refusal comes while the client still sends the snapshot's chunks: it is read to its end first, so
    the client hears UNAUTHENTICATED, not INTERNAL "Internal error from Core" (taken for a broken link). A race:
    unread, about one put in three lost it here, so the test makes several."""
    server = await start_cache_server(str(tmp_path), 1 << 30, security=ServerSecurity(keys=KEYS))
    stranger = client(server.port, "not-a-key-0123456789")
    manifest, blobs = snapshot("big", (24 << 20, 24 << 20), tenant="")
    try:
        for _ in range(8):
            await expect_status(
                stranger.put(manifest, blobs), grpc.StatusCode.UNAUTHENTICATED, "unknown API key"
            )
    finally:
        await stranger.close()
        await server.stop(None)
