"""The cache's gRPC service: Put and Get streamed in chunks, List, Delete, Stat; disk work off the loop."""

from __future__ import annotations

import asyncio
import errno
import sqlite3
import time
from collections.abc import AsyncIterator, Sequence

import grpc
import structlog
from prometheus_client import CollectorRegistry

from cache_svc import CHUNK_BYTES
from cache_svc.budget import OverBudget
from cache_svc.cache_metrics import CacheMetrics
from cache_svc.index import IndexEntry, SnapshotIndex
from cache_svc.manifest import (
    DEFAULT_TENANT,
    Checkpoint,
    CorruptSnapshot,
    InvalidSnapshot,
    LayerRangeError,
    Manifest,
    ModelMismatch,
    Shard,
    SnapshotError,
    SnapshotNotFound,
)
from cache_svc.quarantine import quarantined
from cache_svc.store import PendingSnapshot, ShardReader
from protos import cache_pb2, cache_pb2_grpc
from protos.auth import drain_refused, key_tenant, request_tenant
from protos.decode_guard import guarded
from protos.rpc import ServerSecurity, StartedServer, log_access, start_server
from protos.wire import pack_i32, unpack_i32

log = structlog.get_logger("deltaserve.cache.server")

SERVICE_NAME = cache_pb2.DESCRIPTOR.services_by_name["Cache"].full_name

_STATUS = {
    InvalidSnapshot: grpc.StatusCode.INVALID_ARGUMENT,
    SnapshotNotFound: grpc.StatusCode.NOT_FOUND,
    CorruptSnapshot: grpc.StatusCode.DATA_LOSS,
    LayerRangeError: grpc.StatusCode.OUT_OF_RANGE,
    ModelMismatch: grpc.StatusCode.FAILED_PRECONDITION,
    OverBudget: grpc.StatusCode.RESOURCE_EXHAUSTED,
}


def manifest_from_header(header: cache_pb2.SnapshotManifest) -> Manifest:
    """The Manifest a Put's header declares (InvalidSnapshot when malformed); key and dates are ignored."""
    if len(header.token_ids) % 4:
        raise InvalidSnapshot(
            f"token_ids must be int32 packed; {len(header.token_ids)} bytes is not a multiple of 4"
        )
    return Manifest(
        tenant=header.tenant or DEFAULT_TENANT,
        conversation_id=header.conversation_id,
        token_ids=tuple(unpack_i32(header.token_ids).tolist()),
        checkpoints=tuple(Checkpoint(c.position, c.pinned, c.root) for c in header.checkpoints),
        model_fingerprint=header.model_fingerprint,
        num_layers=header.num_layers,
        page_size=header.page_size,
        dtype=header.dtype,
        shards=tuple(Shard(s.layer_begin, s.layer_end, s.size_bytes, s.sha256) for s in header.shards),
        attributes=dict(header.attributes),
    )


def manifest_header(manifest: Manifest, indices: Sequence[int]) -> cache_pb2.SnapshotManifest:
    """A Get's header: the manifest with its shards cut to `indices` (those the stream carries)."""
    return cache_pb2.SnapshotManifest(
        tenant=manifest.tenant,
        conversation_id=manifest.conversation_id,
        token_ids=pack_i32(manifest.token_ids),
        checkpoints=[
            cache_pb2.Checkpoint(position=c.position, pinned=c.pinned, root=c.root)
            for c in manifest.checkpoints
        ],
        model_fingerprint=manifest.model_fingerprint,
        num_layers=manifest.num_layers,
        page_size=manifest.page_size,
        dtype=manifest.dtype,
        shards=[
            cache_pb2.ShardInfo(
                layer_begin=s.layer_begin, layer_end=s.layer_end, size_bytes=s.size_bytes, sha256=s.sha256
            )
            for s in (manifest.shards[i] for i in indices)
        ],
        attributes=manifest.attributes,
        key=manifest.key,
        created_unix_ns=manifest.created_unix_ns,
    )


def snapshot_info(entry: IndexEntry) -> cache_pb2.SnapshotInfo:
    return cache_pb2.SnapshotInfo(
        key=entry.key,
        conversation_id=entry.conversation_id,
        size_bytes=entry.size_bytes,
        last_used_unix_ns=entry.last_used_ns,
        pinned=entry.pinned,
        num_tokens=entry.num_tokens,
        model_fingerprint=entry.model_fingerprint,
        created_unix_ns=entry.created_ns,
    )


TENANT_PUT_REFUSED = (
    "snapshots are put with the service key (the planner parks conversations); a tenant's key may list, "
    "restore, delete and stat its own"
)


async def _owner(request, context: grpc.aio.ServicerContext) -> tuple[str, str]:
    """(tenant, conversation id) of a request that names one snapshot: the tenant is the caller's key's
    (protos/auth.py), or the one the request names for the service key and an open API."""
    if not request.conversation_id:
        raise InvalidSnapshot("conversation_id is empty")
    return await request_tenant(context, request.tenant), request.conversation_id


async def _abort(context: grpc.aio.ServicerContext, err: SnapshotError) -> None:
    code = _STATUS[type(err)]
    if code in (grpc.StatusCode.DATA_LOSS, grpc.StatusCode.RESOURCE_EXHAUSTED):
        log.warning("cache request refused", code=code.name, error=str(err))
    await context.abort(code, str(err))


class CacheServicer(cache_pb2_grpc.CacheServicer):
    def __init__(self, index: SnapshotIndex) -> None:
        self.index = index
        self.metrics: CacheMetrics | None = None  # set when the process serves metrics

    async def Put(
        self, request_iterator: AsyncIterator[cache_pb2.SnapshotPart], context: grpc.aio.ServicerContext
    ) -> cache_pb2.PutReply:
        if key_tenant() is not None:  # parks come from the planner: a tenant's key putting could fill the
            # cache, and probe by its refusals what the other tenants hold
            await drain_refused(request_iterator)
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, TENANT_PUT_REFUSED)
        pending: PendingSnapshot | None = None
        began = time.perf_counter()
        try:
            async for part in request_iterator:
                kind = part.WhichOneof("part")
                if pending is None:
                    if kind != "header":
                        raise InvalidSnapshot("the first message of a Put must be the header")
                    part.header.tenant = await request_tenant(context, part.header.tenant)
                    manifest = manifest_from_header(part.header)
                    pending = await asyncio.to_thread(self.index.begin_put, manifest)
                elif kind == "chunk":
                    await asyncio.to_thread(pending.write, part.chunk.shard, part.chunk.data)
                else:
                    raise InvalidSnapshot(
                        f"a Put carries one header, then chunks; got {kind or 'an empty part'}"
                    )
            if pending is None:
                raise InvalidSnapshot("an empty Put: the header is missing")
            stored, evicted = await asyncio.to_thread(self.index.commit_put, pending)
        except SnapshotError as err:
            if pending is not None:
                pending.abort()
            await drain_refused(request_iterator)
            await _abort(context, err)
        except (OSError, sqlite3.Error) as err:  # the disk under the cache (and its index): full, failing
            if pending is not None:
                pending.abort()
            await drain_refused(request_iterator)
            # A snapshot published before its index write failed stays on disk: the index adopts it when it
            # next opens (index.py's reconcile), and this put is refused, so its pages stay in the pool.
            full = getattr(err, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or "full" in str(err)
            code = grpc.StatusCode.RESOURCE_EXHAUSTED if full else grpc.StatusCode.UNAVAILABLE
            log.warning("snapshot not stored", code=code.name, error=str(err))
            await context.abort(code, f"the cache could not store the snapshot: {err}")
        finally:
            if pending is not None:
                pending.abort()  # removes what an unfinished put wrote; a no-op after the commit
        if self.metrics is not None:
            self.metrics.park_seconds.observe(time.perf_counter() - began)
            self.metrics.evictions.inc(len(evicted))
        log.info(
            "snapshot stored",
            key=stored.key,
            tenant=stored.tenant,
            size_bytes=stored.size_bytes,
            shards=len(stored.shards),
            evicted=len(evicted),
        )
        return cache_pb2.PutReply(key=stored.key, size_bytes=stored.size_bytes, evicted=len(evicted))

    async def Get(
        self, request: cache_pb2.GetRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[cache_pb2.SnapshotPart]:
        readers: list[ShardReader] = []
        next_read: asyncio.Future | None = None
        opened: Manifest | None = None  # the snapshot being read, once its manifest is open
        began = time.perf_counter()
        try:
            tenant, conversation_id = await _owner(request, context)
            if (
                request.layer_begin < 0
                or request.layer_end < 0
                or 0 < request.layer_end <= request.layer_begin
            ):
                raise InvalidSnapshot(
                    f"empty or negative layer range [{request.layer_begin}, {request.layer_end})"
                )
            manifest, readers = await asyncio.to_thread(
                self.index.open_for_read,
                tenant,
                conversation_id,
                (request.layer_begin, request.layer_end or None),
                request.model_fingerprint or None,
            )
            opened = manifest
            yield cache_pb2.SnapshotPart(header=manifest_header(manifest, [r.index for r in readers]))
            # Each shard is read and checked whole before any of it is sent; the next one is read meanwhile.
            for position, reader in enumerate(readers):
                data = await (next_read or asyncio.to_thread(reader.read))
                next_read = None
                if position + 1 < len(readers):
                    next_read = asyncio.ensure_future(asyncio.to_thread(readers[position + 1].read))
                for offset in range(0, len(data), CHUNK_BYTES):
                    yield cache_pb2.SnapshotPart(
                        chunk=cache_pb2.ShardChunk(shard=position, data=data[offset : offset + CHUNK_BYTES])
                    )
            if self.metrics is not None:
                self.metrics.restore_seconds.observe(time.perf_counter() - began)
        except SnapshotError as err:
            if isinstance(err, CorruptSnapshot) and self.metrics is not None:
                self.metrics.checksum_failures.inc()
            if isinstance(err, CorruptSnapshot):  # never offered again: aside, out of index and budget
                generation = opened.generation if opened is not None else None
                await asyncio.to_thread(self.index.quarantine, err.key, str(err), generation)
            await _abort(context, err)
        finally:
            if next_read is not None:
                next_read.cancel()  # the read may still finish on its thread; its result is dropped
                await asyncio.wait([next_read])
            for reader in readers:
                reader.close()

    async def List(
        self, request: cache_pb2.ListRequest, context: grpc.aio.ServicerContext
    ) -> cache_pb2.ListReply:
        tenant = await request_tenant(context, request.tenant)
        try:
            entries = await asyncio.to_thread(self.index.list, tenant, request.conversation_id or None)
        except SnapshotError as err:
            await _abort(context, err)
        reply = cache_pb2.ListReply(snapshots=[snapshot_info(entry) for entry in entries])
        if request.include_quarantined and not request.conversation_id:
            aside = await asyncio.to_thread(quarantined, self.index.store, tenant)
            reply.snapshots.extend(
                cache_pb2.SnapshotInfo(
                    key=q.key,
                    conversation_id=q.conversation_id,
                    size_bytes=q.size_bytes,
                    num_tokens=q.num_tokens,
                    quarantined=f"{q.reason} (in {q.path})",
                )
                for q in aside
            )
        return reply

    async def Delete(
        self, request: cache_pb2.DeleteRequest, context: grpc.aio.ServicerContext
    ) -> cache_pb2.DeleteReply:
        try:
            entry = await asyncio.to_thread(self.index.delete, *(await _owner(request, context)))
        except SnapshotError as err:
            await _abort(context, err)
        log.info("snapshot deleted", key=entry.key, tenant=entry.tenant, size_bytes=entry.size_bytes)
        return cache_pb2.DeleteReply(key=entry.key, size_bytes=entry.size_bytes)

    async def Stat(
        self, request: cache_pb2.StatRequest, context: grpc.aio.ServicerContext
    ) -> cache_pb2.StatReply:
        tenant = await request_tenant(context, request.tenant)
        # A tenant's key sees its own numbers only; the operator (open API, service key) sees the cache's.
        stat = await asyncio.to_thread(self.index.stat, tenant, scoped=key_tenant() is not None)
        return cache_pb2.StatReply(
            count=stat.count,
            size_bytes=stat.size_bytes,
            budget_bytes=stat.budget_bytes,
            pinned_bytes=stat.pinned_bytes,
            tenant_count=stat.tenant_count,
            tenant_size_bytes=stat.tenant_size_bytes,
        )


async def start_cache_server(
    root_dir: str,
    budget_bytes: int,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    tenant_budget_bytes: int | None = None,
    security: ServerSecurity | None = None,
    metrics: CollectorRegistry | None = None,
) -> StartedServer[CacheServicer]:
    """Opens (or rebuilds) the index under root_dir, then serves Cache, grpc.health.v1 and reflection
    on host:port (0 = any free port). Stopping the server closes the index.

    `tenant_budget_bytes`: each tenant's share of the budget (None: the whole); `security`: TLS and API keys;
    `metrics`: the registry its metrics are recorded in (cache_metrics.py).
    """
    index = await asyncio.to_thread(SnapshotIndex, root_dir, budget_bytes, tenant_budget_bytes)

    async def close_index() -> None:
        index.close()

    servicer = CacheServicer(index)
    if metrics is not None:
        servicer.metrics = CacheMetrics(metrics, index)
    started = await start_server(
        servicer,
        guarded(cache_pb2_grpc.add_CacheServicer_to_server),  # invalid UTF-8: INVALID_ARGUMENT
        (SERVICE_NAME,),
        host,
        port,
        on_stop=[close_index],
        security=security,
    )
    log_access(log, security)
    stat = index.stat(DEFAULT_TENANT)
    log.info(
        "cache listening",
        address=f"{host}:{started.port}",
        root=root_dir,
        snapshots=stat.count,
        size_bytes=stat.size_bytes,
        budget_bytes=budget_bytes,
        tenant_budget_bytes=tenant_budget_bytes,
        index_rebuilt=index.rebuilt,
    )
    return started
