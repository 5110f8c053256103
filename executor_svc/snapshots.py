"""Park and restore of a conversation's KV pages through the cache service (the I/O; snapshot_checks.py
holds the pure checks, restore_guard.py the guard, shard_copies.py the copies between shards and the pool).

A snapshot is one shard per group of `shard_layers` layers. A shard's bytes, in order: for each layer
of the shard, the K of the pages, then their V; each `[pages, page_size, kv_heads, head_dim]` in the
pool's dtype, C order, little-endian (SHARD_LAYOUT). The pool is read and written on a page-copy thread
and the card's copy stream, through its staging in chunks of a fixed size (copy_stream.py): steps running
meanwhile touch none of those pages (the planner parks pages whose last step has committed and restores
into free ones), and a step launched after a restore returned waits for its copies. The cache I/O runs on the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from concurrent.futures import Executor

import grpc
import numpy as np
import structlog

from cache_svc.client import CacheClient
from executor_svc.copy_stream import CopyStream, FreeMemory
from executor_svc.restore_guard import refusal
from executor_svc.runner import StepRunner
from executor_svc.shard_copies import read_shards, write_shards
from executor_svc.snapshot_checks import (
    SHARD_LAYOUT,
    SnapshotRefused,
    cache_refusal,
    check_pages,
    check_park,
    invalid,
    shard_ranges,
    snapshot_fingerprint,
)
from protos import cache_pb2, executor_pb2
from protos.rpc import ChannelSecurity
from protos.wire import pack_i32

log = structlog.get_logger("deltaserve.executor.snapshots")


class Snapshots:
    """Park and Restore for one executor; each call opens its own channel to the cache (a cache that
    restarted in between is simply reached again)."""

    def __init__(
        self,
        runner: StepRunner,
        copies: Executor,
        cache: str | None,
        shard_layers: int,
        cache_channel: ChannelSecurity | None = None,
        free_memory: FreeMemory | None = None,
    ) -> None:
        described = runner.describe()
        pool = runner.kv_pool
        self._pool = pool
        self._copies = copies
        self._cache = cache
        self._cache_channel = cache_channel  # TLS and the service key, when configured
        self._device = runner.device
        self._layer_begin, self._layer_end = described.layer_begin, described.layer_end
        self._num_layers = described.num_layers
        self._pool_pages = pool.num_pages
        self._page_shape = tuple(pool.k.shape[2:])  # (page_size, kv_heads, head_dim)
        self._shards = shard_ranges(self._layer_begin, self._layer_end, shard_layers)
        page_size, kv_heads, head_dim = self._page_shape
        self._stage = runner.model.stage
        self._fingerprint = snapshot_fingerprint(
            runner.fingerprint, described.dtype, page_size, self._num_layers, kv_heads, head_dim
        )
        self._recurrent = runner.state_pool is not None
        # Made by the first park or restore on the card; `free_memory` replaces the card's memory query.
        self.copy_stream = CopyStream(runner.device, free_memory)
        self.copy_stream.warm((pool.k, pool.v))

    def _require_cache(self) -> str:
        if self._cache is None:
            raise SnapshotRefused(grpc.StatusCode.FAILED_PRECONDITION, "no cache service configured")
        if self._recurrent:
            raise SnapshotRefused(
                grpc.StatusCode.FAILED_PRECONDITION,
                "snapshots of a model with recurrent layers are not supported yet (its recurrent states would "
                "not travel with the pages)",
            )
        return self._cache

    async def park(self, request: executor_pb2.ParkPagesRequest) -> executor_pb2.ParkPagesReply:
        addr = self._require_cache()
        tokens, pages = check_park(request, self._page_shape[0], self._pool_pages)
        started = time.perf_counter()
        gathered = await asyncio.get_running_loop().run_in_executor(self._copies, self._read_for_park, pages)
        if gathered is None:  # a later stage of a split: its shards went to the first, which puts them
            return executor_pb2.ParkPagesReply()
        shards, blobs = gathered
        page_size, kv_heads, head_dim = self._page_shape
        manifest = {
            "tenant": request.tenant,
            "conversation_id": request.conversation_id,
            "token_ids": tokens,
            "checkpoints": [
                {"position": c.position, "pinned": c.pinned, "root": c.root} for c in request.checkpoints
            ],
            "model_fingerprint": self._fingerprint,
            "num_layers": self._num_layers,
            "page_size": page_size,
            "dtype": str(self._pool.k.dtype).removeprefix("torch."),
            "shards": [{"layers": [begin, end]} for begin, end in shards],
            "attributes": {
                "kv_layout": SHARD_LAYOUT,
                "pages": str(len(pages)),
                "kv_heads": str(kv_heads),
                "head_dim": str(head_dim),
            },
        }
        try:
            async with CacheClient(addr, self._cache_channel) as cache:
                stored = await cache.put(manifest, blobs)
        except grpc.aio.AioRpcError as err:
            raise cache_refusal(err, addr) from err
        log.info(
            "parked",
            conversation_id=request.conversation_id,
            tokens=len(tokens),
            pages=len(pages),
            bytes=stored["size_bytes"],
            seconds=round(time.perf_counter() - started, 4),
        )
        return executor_pb2.ParkPagesReply(bytes=stored["size_bytes"])

    async def restore(self, request: executor_pb2.RestorePagesRequest) -> executor_pb2.RestorePagesReply:
        """Writes nothing unless the whole snapshot arrived and checked out (a corrupt one is DATA_LOSS
        with the pool untouched). Only a failure during the write itself leaves destination pages partly
        written; those pages are the planner's to free, and no other page changes."""
        addr = self._require_cache()
        if not request.conversation_id:
            raise invalid("conversation_id is empty")
        pages = check_pages(request.pages, self._pool_pages)
        self._check_guard()
        started = time.perf_counter()
        try:
            async with CacheClient(addr, self._cache_channel) as cache:
                manifest, blobs = await cache.get(
                    request.tenant,
                    request.conversation_id,
                    layers=(self._layer_begin, self._layer_end),
                    fingerprint=self._fingerprint,
                )
        except grpc.aio.AioRpcError as err:
            raise cache_refusal(err, addr) from err
        ranges = self._check_snapshot(manifest, blobs, len(pages))
        layers = self._layer_begin, self._layer_end
        await asyncio.get_running_loop().run_in_executor(
            self._copies, write_shards, self.copy_stream, self._pool, layers, ranges, blobs, pages
        )
        log.info(
            "restored",
            conversation_id=request.conversation_id,
            tokens=len(manifest["token_ids"]),
            pages=len(pages),
            bytes=sum(map(len, blobs)),
            seconds=round(time.perf_counter() - started, 4),
        )
        return executor_pb2.RestorePagesReply(
            token_ids=pack_i32(manifest["token_ids"]),
            checkpoints=[
                cache_pb2.Checkpoint(position=c["position"], pinned=c["pinned"], root=c["root"])
                for c in manifest["checkpoints"]
            ],
        )

    def _check_guard(self) -> None:
        """The restore guard: refused (RESOURCE_EXHAUSTED, the pool untouched) only for a card with no copy
        stream yet and less free memory than its first use needs."""
        why = refusal(self.copy_stream.cards())
        if why is not None:
            raise SnapshotRefused(grpc.StatusCode.RESOURCE_EXHAUSTED, why)

    def _check_snapshot(self, manifest: dict, blobs: list[bytes], num_pages: int) -> list[tuple[int, int]]:
        """The layer ranges of the shards, once the snapshot is known to fit this pool and these pages."""
        attributes = manifest["attributes"]
        if attributes.get("kv_layout") != SHARD_LAYOUT:
            raise SnapshotRefused(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"snapshot layout {attributes.get('kv_layout')!r}; this executor reads {SHARD_LAYOUT!r}",
            )
        page_size, kv_heads, head_dim = self._page_shape
        dtype = str(self._pool.k.dtype).removeprefix("torch.")
        theirs = (
            manifest["page_size"],
            manifest["dtype"],
            attributes.get("kv_heads"),
            attributes.get("head_dim"),
        )
        ours = (page_size, dtype, str(kv_heads), str(head_dim))
        if theirs != ours:  # the fingerprint covers these; a second look costs nothing
            raise SnapshotRefused(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"snapshot pages (page size, dtype, kv heads, head dim) {theirs}; this pool's are {ours}",
            )
        parked = int(attributes.get("pages", "0"))
        if parked != num_pages:
            raise invalid(f"the snapshot holds {parked} pages; {num_pages} destination pages given")
        ranges = [tuple(shard["layers"]) for shard in manifest["shards"]]
        page_bytes = 2 * num_pages * self._pool.k[0, 0].numel() * self._pool.k.element_size()  # K and V
        for (begin, end), blob in zip(ranges, blobs, strict=True):
            if len(blob) != (end - begin) * page_bytes:
                raise SnapshotRefused(
                    grpc.StatusCode.DATA_LOSS,
                    f"shard of layers [{begin}, {end}) is {len(blob)} bytes; {num_pages} pages make "
                    f"{(end - begin) * page_bytes}",
                )
        return ranges

    def _read_for_park(self, pages: np.ndarray) -> tuple[list[tuple[int, int]], list[bytes]] | None:
        """On the page-copy thread: the shards of the pages, this stage's; on a split every stage's at the
        first stage (None at the others), so the first puts one snapshot, complete or none."""
        if not self._stage.split:
            return self._shards, self._read_pages(pages)
        try:
            blobs = self._read_pages(pages)
        except Exception:
            with contextlib.suppress(RuntimeError):  # the transfers of this park, kept in step
                self._stage.gather_shards(self._shards, None)
            raise
        return self._stage.gather_shards(self._shards, blobs)

    def _read_pages(self, pages: np.ndarray) -> list[bytes]:
        return read_shards(self.copy_stream, self._pool, self._layer_begin, self._shards, pages)
