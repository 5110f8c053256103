"""A snapshot's shards to and from a stage's KV pool, through the card's copy stream and its staging (the
byte order, SHARD_LAYOUT, in snapshots.py's docstring: for each layer of a shard the K of the pages, then
their V). Run on the page-copy thread."""

from __future__ import annotations

import numpy as np

from executor_svc.copy_stream import CopyStream
from executor_svc.kv_pool import KVPool


def read_shards(
    stream: CopyStream, pool: KVPool, layer_begin: int, shards: list[tuple[int, int]], pages: np.ndarray
) -> list[bytes]:
    """The pages' bytes of each shard [begin, end) of the pool's layers (the first of which is `layer_begin`)."""
    index = pages.astype(np.int64)
    blobs = []
    for begin, end in shards:
        first, last = begin - layer_begin, end - layer_begin
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
) -> None:
    """Each shard [begin, end) of `blobs` into the pages of the pool, which holds layers [layers[0], layers[1]):
    a shard may reach past them (a layer split), and only its part in them is written."""
    index = pages.astype(np.int64)
    layer_begin, layer_end = layers
    for (begin, end), blob in zip(shards, blobs, strict=True):
        # u8[layers, 2 (K, V), pages, page bytes]
        kv = np.frombuffer(blob, dtype=np.uint8).reshape(end - begin, 2, len(pages), -1)
        low, high = max(begin, layer_begin), min(end, layer_end)
        first, last = low - layer_begin, high - layer_begin
        stream.scatter((pool.k[first:last], pool.v[first:last]), kv[low - begin : high - begin], index)
