"""Park and restore of a conversation's KV pages through the cache service (the I/O; snapshot_checks.py
holds the pure checks, restore_guard.py the guard, shard_copies.py the copies between shards and the pool).

A snapshot is one shard per group of `shard_layers` layers. A shard's bytes, in order: for each layer
of the shard, the K of the pages, then their V; each `[pages, page_size, kv_heads, head_dim]` in the
pool's dtype, C order, little-endian (SHARD_LAYOUT). A hybrid model's shard holds those of its
full-attention layers only, then the recurrent states of its other layers at each parked checkpoint
(snapshot_states.py, HYBRID_LAYOUT). The pool is read and written on a page-copy thread
and the card's copy stream, through its staging in chunks of a fixed size (copy_stream.py): steps running
meanwhile touch none of those pages (the planner parks pages whose last step has committed and restores
into free ones), and a step launched after a restore returned waits for its copies. The cache I/O runs on the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
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
    check_state_slots,
    invalid,
    shard_ranges,
    snapshot_fingerprint,
)
from executor_svc.snapshot_states import HYBRID_LAYOUT, StateShards, layer_kinds, restored_states
from protos import cache_pb2, executor_pb2
from protos.rpc import INTERNAL_CHANNEL_OPTIONS, ChannelSecurity
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
        self._vocab_size, self._max_seq_len = described.vocab_size, described.max_seq_len
        self._pool_pages = pool.num_pages
        self._page_shape = tuple(pool.k.shape[2:])  # (page_size, kv_heads, head_dim)
        self._shards = shard_ranges(self._layer_begin, self._layer_end, shard_layers)
        page_size, kv_heads, head_dim = self._page_shape
        self._stage = runner.model.stage
        self._kinds = layer_kinds(runner.model, self._layer_begin)
        state_pool = runner.state_pool
        self._states = StateShards(state_pool, self._kinds) if state_pool is not None else None
        self._state_slots = 0 if state_pool is None else state_pool.num_slots
        self._layout = SHARD_LAYOUT if self._states is None else HYBRID_LAYOUT
        pattern = (
            ""
            if self._states is None
            else f"{self._kinds.pattern(self._num_layers)}, {self._states.describe()}"
        )
        self._fingerprint = snapshot_fingerprint(
            runner.fingerprint, described.dtype, page_size, self._num_layers, kv_heads, head_dim, pattern
        )
        # Made by the first park or restore on the card; `free_memory` replaces the card's memory query.
        self.copy_stream = CopyStream(runner.device, free_memory)
        if pool.k.shape[0]:  # none in a hybrid's stage of gated delta nets only
            self.copy_stream.warm((pool.k, pool.v))
        if self._states is not None:
            self._states.warm(self.copy_stream)

    @property
    def enabled(self) -> bool:
        """Whether parks and restores reach a cache service."""
        return self._cache is not None

    def _require_cache(self) -> str:
        if self._cache is None:
            raise SnapshotRefused(grpc.StatusCode.FAILED_PRECONDITION, "no cache service configured")
        return self._cache

    async def park(self, request: executor_pb2.ParkPagesRequest) -> executor_pb2.ParkPagesReply:
        try:
            addr = self._require_cache()
            tokens, pages = check_park(
                request, self._page_shape[0], self._pool_pages, self._vocab_size, self._max_seq_len
            )
            # A hybrid's checkpoints each carry their state: one slot each, in position order.
            states = check_state_slots(request.state_slots, self._state_slots, len(request.checkpoints))
        except SnapshotRefused:
            if self._stage.split:  # the other stages of the park wait for this one's part: it sends none
                await asyncio.get_running_loop().run_in_executor(self._copies, self._gather_nothing)
            raise
        started = time.perf_counter()
        gathered = await asyncio.get_running_loop().run_in_executor(
            self._copies, self._read_for_park, pages, states
        )
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
                "kv_layout": self._layout,
                "pages": str(len(pages)),
                "states": str(len(states)),
                "kv_heads": str(kv_heads),
                "head_dim": str(head_dim),
            },
        }
        try:
            async with CacheClient(addr, self._cache_channel, options=INTERNAL_CHANNEL_OPTIONS) as cache:
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
        states = check_state_slots(request.state_slots, self._state_slots, None)
        self._check_guard()
        started = time.perf_counter()
        try:
            async with CacheClient(addr, self._cache_channel, options=INTERNAL_CHANNEL_OPTIONS) as cache:
                manifest, blobs = await cache.get(
                    request.tenant,
                    request.conversation_id,
                    layers=(self._layer_begin, self._layer_end),
                    fingerprint=self._fingerprint,
                )
        except grpc.aio.AioRpcError as err:
            raise cache_refusal(err, addr) from err
        ranges, parked_states = self._check_snapshot(manifest, blobs, len(pages))
        checkpoints = manifest["checkpoints"]
        # Short of slots: the pin's state and the newest others' (restored_states), into the last slots given.
        chosen = restored_states([c["pinned"] for c in checkpoints], min(len(states), parked_states))
        states = states[len(states) - len(chosen) :]
        await asyncio.get_running_loop().run_in_executor(
            self._copies, self._write, pages, ranges, blobs, parked_states, states, chosen
        )
        if self._states is not None:  # those whose state came back; the others have none
            checkpoints = [checkpoints[i] for i in chosen]
        log.info(
            "restored",
            conversation_id=request.conversation_id,
            tokens=len(manifest["token_ids"]),
            pages=len(pages),
            states=len(states),
            bytes=sum(map(len, blobs)),
            seconds=round(time.perf_counter() - started, 4),
        )
        return executor_pb2.RestorePagesReply(
            token_ids=pack_i32(manifest["token_ids"]),
            checkpoints=[
                cache_pb2.Checkpoint(position=c["position"], pinned=c["pinned"], root=c["root"])
                for c in checkpoints
            ],
        )

    def _check_guard(self) -> None:
        """The restore guard: refused (RESOURCE_EXHAUSTED, the pool untouched) only for a card with no copy
        stream yet and less free memory than its first use needs."""
        why = refusal(self.copy_stream.cards())
        if why is not None:
            raise SnapshotRefused(grpc.StatusCode.RESOURCE_EXHAUSTED, why)

    def _check_snapshot(
        self, manifest: dict, blobs: list[bytes], num_pages: int
    ) -> tuple[list[tuple[int, int]], int]:
        """The layer ranges of the shards and the states parked, once the snapshot is known to fit this pool
        and these pages."""
        attributes = manifest["attributes"]
        if attributes.get("kv_layout") != self._layout:
            raise SnapshotRefused(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"snapshot layout {attributes.get('kv_layout')!r}; this executor reads {self._layout!r}",
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
        states = int(attributes.get("states", "0"))
        ranges = [tuple(shard["layers"]) for shard in manifest["shards"]]
        for (begin, end), blob in zip(ranges, blobs, strict=True):
            size = self._kv_bytes(begin, end, num_pages)
            size += self._states.nbytes(begin, end, states) if self._states is not None else 0
            if len(blob) != size:
                raise SnapshotRefused(
                    grpc.StatusCode.DATA_LOSS,
                    f"shard of layers [{begin}, {end}) is {len(blob)} bytes; {num_pages} pages and {states} "
                    f"states make {size}",
                )
        return ranges, states

    def _kv_bytes(self, begin: int, end: int, num_pages: int) -> int:
        """The K and V bytes of a shard of layers [begin, end)."""
        page_bytes = 2 * num_pages * math.prod(self._page_shape) * self._pool.k.element_size()
        return self._kinds.kv_count(begin, end) * page_bytes

    def _read_for_park(
        self, pages: np.ndarray, states: np.ndarray
    ) -> tuple[list[tuple[int, int]], list[bytes]] | None:
        """On the page-copy thread: the shards of the pages (and states), this stage's; on a split every stage's
        at the first stage (None at the others), so the first puts one snapshot, complete or none."""
        if not self._stage.split:
            return self._shards, self._read_pages(pages, states)
        try:
            blobs = self._read_pages(pages, states)
        except Exception:
            self._gather_nothing()
            raise
        return self._stage.gather_shards(self._shards, blobs)

    def _gather_nothing(self) -> None:
        """On the page-copy thread: this stage's part in a split park that it refused or could not read. Every
        stage takes part in each park's transfers, so none waits on another (a stage without a cache used to
        leave the first waiting in its receive) and the next park's transfers do not read this one's."""
        with contextlib.suppress(RuntimeError):  # the first stage's "the park is incomplete": refused already
            self._stage.gather_shards(self._shards, None)

    def _read_pages(self, pages: np.ndarray, states: np.ndarray) -> list[bytes]:
        stream = self.copy_stream
        blobs = read_shards(stream, self._pool, self._layer_begin, self._shards, pages, self._kinds)
        if self._states is None:
            return blobs
        return [blob + self._states.read(stream, *shard, states) for blob, shard in zip(blobs, self._shards)]

    def _write(
        self,
        pages: np.ndarray,
        ranges: list[tuple[int, int]],
        blobs: list[bytes],
        parked_states: int,
        states: np.ndarray,
        chosen: list[int],
    ) -> None:
        """On the page-copy thread: the shards' pages, and the `chosen` of their `parked_states` states into the
        slots `states` (a hybrid model's), each shard's part in this stage's layers."""
        stream, layers = self.copy_stream, (self._layer_begin, self._layer_end)
        if self._states is None:
            write_shards(stream, self._pool, layers, ranges, blobs, pages)
            return
        kv_parts = [
            blob[: self._kv_bytes(begin, end, len(pages))] for (begin, end), blob in zip(ranges, blobs)
        ]
        write_shards(stream, self._pool, layers, ranges, kv_parts, pages, self._kinds)
        for (begin, end), blob, kv in zip(ranges, blobs, kv_parts, strict=True):
            data = np.frombuffer(blob, dtype=np.uint8)[len(kv) :]
            self._states.write(stream, layers, begin, end, data, parked_states, states, chosen)
