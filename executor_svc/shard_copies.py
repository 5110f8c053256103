"""A snapshot's shards to and from a stage's KV pool, through the card's copy stream and its staging (the
byte order, SHARD_LAYOUT, in snapshots.py's docstring: for each layer of a shard the K of the pages, then
their V; a hybrid model's shard holds its full-attention layers' only, `kinds` says which, and
snapshot_states.py moves the rest). Run on the page-copy thread."""

from __future__ import annotations

import numpy as np

from executor_svc.copy_stream import CopyStream
from executor_svc.kv_pool import KVPool
from executor_svc.snapshot_states import LayerKinds


def read_shards(
    stream: CopyStream,
    pool: KVPool,
    layer_begin: int,
    shards: list[tuple[int, int]],
    pages: np.ndarray,
    kinds: LayerKinds | None = None,
) -> list[bytes]:
    """The pages' bytes of each shard [begin, end) of the model's layers, the pool's from `layer_begin` on
    (every layer a KV layer unless `kinds` says otherwise)."""
    kinds = kinds or LayerKinds(frozenset(), layer_begin)
    index = pages.astype(np.int64)
    blobs = []
    for begin, end in shards:
        first, last = kinds.kv_range(begin, end)
        if first == last:  # a shard of recurrent layers only
            blobs.append(b"")
            continue
        # u8[layers, 2 (K, V), pages, page bytes]: the shard's byte order
        blobs.append(stream.gather((pool.k[first:last], pool.v[first:last]), index).tobytes())
    return blobs


def write_shards(
    stream: CopyStream,
    pool: KVPool,
    layers: tuple[int, int],
    shards: list[tuple[int, int]],
    blobs: list[bytes],
    pages: np.ndarray,
    kinds: LayerKinds | None = None,
) -> None:
    """Each shard [begin, end) of `blobs` into the pages of the pool, which holds layers [layers[0], layers[1]):
    a shard may reach past them (a layer split), and only its part in them is written."""
    index = pages.astype(np.int64)
    layer_begin, layer_end = layers
    kinds = kinds or LayerKinds(frozenset(), layer_begin)
    for (begin, end), blob in zip(shards, blobs, strict=True):
        low, high = max(begin, layer_begin), min(end, layer_end)
        first, last = kinds.kv_range(low, high)
        if first == last:  # none of this pool's KV layers in the shard
            continue
        # u8[layers, 2 (K, V), pages, page bytes]
        kv = np.frombuffer(blob, dtype=np.uint8).reshape(kinds.kv_count(begin, end), 2, len(pages), -1)
        skip = kinds.kv_count(begin, low)  # the shard's KV layers before this pool's
        stream.scatter((pool.k[first:last], pool.v[first:last]), kv[skip : skip + last - first], index)
