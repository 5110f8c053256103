"""Async client of the cache service (deltaserve.v1.Cache): snapshots as (manifest dict, shard blobs)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Mapping, Sequence

import grpc

from cache_svc import CHUNK_BYTES
from cache_svc.manifest import DEFAULT_TENANT
from protos import cache_pb2, cache_pb2_grpc
from protos.rpc import CHANNEL_OPTIONS, ChannelSecurity, open_channel, wait_serving
from protos.wire import pack_i32, unpack_i32


def put_parts(manifest: Mapping, shards: Sequence) -> Iterator[cache_pb2.SnapshotPart]:
    """A Put's stream: the header, then each shard's bytes in chunks of at most CHUNK_BYTES.

    `manifest` holds tenant (default "default"), conversation_id, token_ids, checkpoints
    ([{"position", "pinned", "root"}], the flags optional), model_fingerprint, num_layers, page_size, dtype, attributes (optional)
    and shards ([{"layers": [a, b]}, with "sha256" optional]), one per blob of `shards` (bytes-like).
    Fields left out are sent empty, and the service says what is missing.
    """
    declared = list(manifest.get("shards", ()))
    if len(declared) != len(shards):
        raise ValueError(f"the manifest declares {len(declared)} shards; {len(shards)} blobs were given")
    views = [memoryview(data).cast("B") for data in shards]
    yield cache_pb2.SnapshotPart(
        header=cache_pb2.SnapshotManifest(
            tenant=manifest.get("tenant", DEFAULT_TENANT),
            conversation_id=manifest.get("conversation_id", ""),
            token_ids=pack_i32(manifest.get("token_ids", ())),
            checkpoints=[
                cache_pb2.Checkpoint(
                    position=c["position"], pinned=c.get("pinned", False), root=c.get("root", False)
                )
                for c in manifest.get("checkpoints", ())
            ],
            model_fingerprint=manifest.get("model_fingerprint", ""),
            num_layers=manifest.get("num_layers", 0),
            page_size=manifest.get("page_size", 0),
            dtype=manifest.get("dtype", ""),
            shards=[
                cache_pb2.ShardInfo(
                    layer_begin=shard["layers"][0],
                    layer_end=shard["layers"][1],
                    size_bytes=view.nbytes,
                    sha256=shard.get("sha256", ""),
                )
                for shard, view in zip(declared, views)
            ],
            attributes=manifest.get("attributes", {}),
        )
    )
    for index, view in enumerate(views):
        for offset in range(0, view.nbytes, CHUNK_BYTES):
            yield cache_pb2.SnapshotPart(
                chunk=cache_pb2.ShardChunk(shard=index, data=view[offset : offset + CHUNK_BYTES].tobytes())
            )


def manifest_dict(header: cache_pb2.SnapshotManifest) -> dict:
    """A Get's header as the dict put takes, plus key, created_unix_ns and each shard's size and sha256."""
    return {
        "key": header.key,
        "tenant": header.tenant,
        "conversation_id": header.conversation_id,
        "token_ids": unpack_i32(header.token_ids).tolist(),
        "checkpoints": [
            {"position": c.position, "pinned": c.pinned, "root": c.root} for c in header.checkpoints
        ],
        "model_fingerprint": header.model_fingerprint,
        "num_layers": header.num_layers,
        "page_size": header.page_size,
        "dtype": header.dtype,
        "attributes": dict(header.attributes),
        "created_unix_ns": header.created_unix_ns,
        "shards": [
            {"layers": [s.layer_begin, s.layer_end], "size_bytes": s.size_bytes, "sha256": s.sha256}
            for s in header.shards
        ],
    }


def _info_dict(info: cache_pb2.SnapshotInfo) -> dict:
    return {
        "key": info.key,
        "conversation_id": info.conversation_id,
        "size_bytes": info.size_bytes,
        "last_used_unix_ns": info.last_used_unix_ns,
        "pinned": info.pinned,
        "num_tokens": info.num_tokens,
        "model_fingerprint": info.model_fingerprint,
        "created_unix_ns": info.created_unix_ns,
        "quarantined": info.quarantined,
    }


# What gRPC's Python client sets as a call's status when sending a message fails in the transport before the
# call's own status arrived (grpc/aio/_call.py, set_internal_error): the connection broke, the service said nothing
_SEND_FAILED = "Internal error from Core"


def _transport_failure(error: grpc.aio.AioRpcError) -> grpc.aio.AioRpcError:
    """`error`, but UNAVAILABLE where the client's own send failed (a connection its keepalive closed on a hung
    cache): the service never answered INTERNAL, and callers tell an unreachable cache by UNAVAILABLE."""
    if error.code() is not grpc.StatusCode.INTERNAL or error.details() != _SEND_FAILED:
        return error
    return grpc.aio.AioRpcError(
        grpc.StatusCode.UNAVAILABLE,
        error.initial_metadata(),
        error.trailing_metadata(),
        "the connection to the cache service broke while the snapshot was being sent",
        error.debug_error_string(),
    )


class CacheClient:
    """One channel to a cache service; use as `async with CacheClient("host:port") as cache:`.

    Errors come as the grpc.aio.AioRpcError of the call (NOT_FOUND, DATA_LOSS, ...), as they are.
    `options`: a deltaserve service passes INTERNAL_CHANNEL_OPTIONS (keepalive on its link to the cache).
    """

    def __init__(
        self, addr: str, security: ChannelSecurity | None = None, *, options: Sequence = CHANNEL_OPTIONS
    ) -> None:
        self.addr = addr
        self._channel = open_channel(addr, security, options=options)  # TLS and an API key when configured
        self._stub = cache_pb2_grpc.CacheStub(self._channel)

    async def __aenter__(self) -> CacheClient:
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    async def wait_ready(self, timeout: float) -> None:
        """Returns once the service's health check says SERVING; TimeoutError otherwise."""
        await wait_serving(self._channel, timeout)

    async def put(self, manifest: Mapping, shards: Sequence) -> dict:
        """Stores (or replaces) the conversation's snapshot; see put_parts for the manifest's fields.

        Returns {"key", "size_bytes", "evicted"} (evicted: how many snapshots made room for it).
        """
        # Written part by part: a Put the service refuses early (RESOURCE_EXHAUSTED) ends the call while
        # parts are still going out; writing from an iterator then reports INTERNAL "Internal error from
        # Core" instead of the service's status. A write that fails here awaits the call's own status.
        call = self._stub.Put()
        try:
            for part in put_parts(manifest, shards):
                await call.write(part)
            await call.done_writing()
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            pass  # the call has ended: its status is raised below
        try:
            reply = await call
        except grpc.aio.AioRpcError as error:
            raise _transport_failure(error) from None
        return {"key": reply.key, "size_bytes": reply.size_bytes, "evicted": reply.evicted}

    async def get(
        self,
        tenant: str,
        conversation_id: str,
        layers: tuple[int, int] | None = None,
        fingerprint: str | None = None,
    ) -> tuple[dict, list[bytes]]:
        """The snapshot's manifest and the blobs of the shards covering layers [a, b) (all when None),
        aligned with manifest["shards"]. With `fingerprint`, a snapshot of another model is refused."""
        layer_begin, layer_end = layers or (0, 0)
        call = self._stub.Get(
            cache_pb2.GetRequest(
                tenant=tenant,
                conversation_id=conversation_id,
                layer_begin=layer_begin,
                layer_end=layer_end,
                model_fingerprint=fingerprint or "",
            )
        )
        header = None
        chunks: list[list[bytes]] = []
        async for part in call:
            if part.HasField("header"):
                header = part.header
                chunks = [[] for _ in header.shards]
            else:
                chunks[part.chunk.shard].append(part.chunk.data)
        if header is None:
            raise RuntimeError(f"the cache's Get stream of {conversation_id!r} ended without a header")
        return manifest_dict(header), [b"".join(pieces) for pieces in chunks]

    async def list(
        self,
        tenant: str = DEFAULT_TENANT,
        conversation_id: str | None = None,
        timeout: float | None = None,
        include_quarantined: bool = False,
    ) -> list[dict]:
        """The tenant's snapshots, most recently used first (NOT_FOUND for a conversation it has none of);
        with include_quarantined, then those set aside (their "quarantined" says why and where)."""
        request = cache_pb2.ListRequest(
            tenant=tenant, conversation_id=conversation_id or "", include_quarantined=include_quarantined
        )
        reply = await self._stub.List(request, timeout=timeout)
        return [_info_dict(info) for info in reply.snapshots]

    async def delete(self, tenant: str, conversation_id: str, timeout: float | None = None) -> dict:
        """Deletes the snapshot; returns {"key", "size_bytes"} (NOT_FOUND when there is none)."""
        reply = await self._stub.Delete(
            cache_pb2.DeleteRequest(tenant=tenant, conversation_id=conversation_id), timeout=timeout
        )
        return {"key": reply.key, "size_bytes": reply.size_bytes}

    async def stat(self, tenant: str = DEFAULT_TENANT) -> dict:
        """count, size_bytes, budget_bytes, pinned_bytes of the whole cache, and the tenant's own share."""
        reply = await self._stub.Stat(cache_pb2.StatRequest(tenant=tenant))
        return {
            "count": reply.count,
            "size_bytes": reply.size_bytes,
            "budget_bytes": reply.budget_bytes,
            "pinned_bytes": reply.pinned_bytes,
            "tenant_count": reply.tenant_count,
            "tenant_size_bytes": reply.tenant_size_bytes,
        }
