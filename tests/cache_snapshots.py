"""Snapshots for the cache service's tests (a manifest and its shards' blobs) and a check of the status a
refused call gets."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

MiB = 1024 * 1024


def snapshot(conversation_id="conv", sizes=(1000, 0, 3000), *, tenant="default", seed=0, pinned=False):
    """A manifest dict for CacheClient.put and its shard blobs (two layers a shard)."""
    rng = np.random.default_rng(seed)
    manifest = {
        "tenant": tenant,
        "conversation_id": conversation_id,
        "token_ids": list(range(5, 45)),
        "checkpoints": [
            {"position": 16, "pinned": pinned, "root": True},  # each checkpoint's flags travel with it
            {"position": 40, "pinned": False, "root": False},
        ],
        "model_fingerprint": "model-a",
        "num_layers": 2 * len(sizes),
        "page_size": 16,
        "dtype": "float32",
        "attributes": {"kv_heads": "3"},
        "shards": [{"layers": [2 * i, 2 * i + 2]} for i in range(len(sizes))],
    }
    return manifest, [rng.integers(0, 256, size, dtype=np.uint8).tobytes() for size in sizes]


async def expect_status(awaitable, code: grpc.StatusCode, *fragments: str) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await awaitable
    assert refused.value.code() == code, refused.value.details()
    for fragment in fragments:
        assert fragment in refused.value.details()
    return refused.value.details()
