"""The restore guard's first use on the GPU: what a card's first restore allocates (its copy stream, events and
fixed-size staging, made once) against the guard's RESTORE_FIRST_USE_BYTES, and that later restores and parks of
any size, many times the staging, leave the free memory where it was.

    python bench/first_copy.py [--out docs/bench/first_copy.json] [--commit HASH] [--no-warm]

A SmolLM2-sized pool (30 layers x 1,024 pages of K and V, bf16) on the card; the executor's start-up warm-up of
the copy kernels (`--no-warm`: none, to see what a cold kernel's first launch costs); then restores of snapshots
of 256 pages (90 MiB, sharded by 8 layers as the executor does) into it through executor_svc.shard_copies, the
executor's own copies: the first, then restores of 16, 256 and 1,000 pages and parks of them. Records the free
memory (cudaMemGetInfo) and torch's reserved bytes around each; fails when the first use is over the guard's
constant or a later copy changed the free memory.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import commit_hash, write_json
from executor_svc.copy_stream import CopyStream
from executor_svc.kv_pool import KVPool
from executor_svc.restore_guard import MIB, RESTORE_FIRST_USE_BYTES, STAGING_BYTES
from executor_svc.shard_copies import read_shards, write_shards
from executor_svc.snapshot_checks import shard_ranges

LAYERS, POOL_PAGES, PAGE_SIZE, KV_HEADS, HEAD_DIM, SHARD_LAYERS = 30, 1024, 16, 3, 64, 8
FIRST_PAGES, LATER_PAGES = 256, (16, 256, 1000)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="docs/bench/first_copy.json")
    parser.add_argument("--commit", default=None, help="the commit measured (default: git rev-parse HEAD)")
    parser.add_argument(
        "--no-warm", action="store_true", help="skip the executor's warm-up of the copy kernels"
    )
    args = parser.parse_args()
    device = torch.device("cuda")
    torch.cuda.init()
    pool = KVPool(LAYERS, POOL_PAGES, PAGE_SIZE, KV_HEADS, HEAD_DIM, torch.bfloat16, device)
    shards = shard_ranges(0, LAYERS, SHARD_LAYERS)
    page_bytes = 2 * PAGE_SIZE * KV_HEADS * HEAD_DIM * 2  # K and V of a layer, bf16
    rng = np.random.default_rng(0)

    def snapshot(pages: int) -> tuple[np.ndarray, list[bytes]]:
        """`pages` distinct pool pages (never the sink) and a snapshot's random shards for them."""
        chosen = rng.permutation(np.arange(1, POOL_PAGES))[:pages].astype(np.int32)
        blobs = [rng.bytes((end - begin) * pages * page_bytes) for begin, end in shards]
        return chosen, blobs

    def free() -> int:
        torch.cuda.synchronize()
        return torch.cuda.mem_get_info(device)[0]

    stream = CopyStream(device)
    first_pages, first_blobs = snapshot(FIRST_PAGES)
    later = [snapshot(pages) for pages in LATER_PAGES]
    free_start = free()
    if not args.no_warm:
        stream.warm((pool.k, pool.v))
    free_before, reserved_before = free(), torch.cuda.memory_reserved(device)
    write_shards(stream, pool, (0, LAYERS), shards, first_blobs, first_pages)
    free_after_first, reserved_after_first = free(), torch.cuda.memory_reserved(device)
    assert read_shards(stream, pool, 0, shards, first_pages) == first_blobs, "the restored pages differ"
    changes = []
    for pages, blobs in later * 2:
        write_shards(stream, pool, (0, LAYERS), shards, blobs, pages)
        changes.append(free_after_first - free())
        assert read_shards(stream, pool, 0, shards, pages) == blobs, "the restored pages differ"
        changes.append(free_after_first - free())
    first_use = free_before - free_after_first
    record = {
        "bench": "first_copy",
        "commit": args.commit or commit_hash(),
        "gpu": torch.cuda.get_device_name(device),
        "warm": not args.no_warm,
        "warm_bytes": free_start - free_before,  # the executor's start-up, before any restore
        "first_restore_bytes": FIRST_PAGES * LAYERS * page_bytes,
        "first_use_bytes": first_use,
        "first_use_mib": round(first_use / MIB, 3),
        "staging_bytes": STAGING_BYTES,
        "allocator_bytes": reserved_after_first - reserved_before,  # of the first use: the staging
        "stream_bytes": first_use - (reserved_after_first - reserved_before),  # the rest: stream, events
        "guard_first_use_bytes": RESTORE_FIRST_USE_BYTES,
        "guard_first_use_mib": RESTORE_FIRST_USE_BYTES // MIB,
        "later_pages": list(LATER_PAGES) * 2,
        "later_free_change_bytes": changes,  # after each restore, then after its park
        "stream_ready": stream.ready,
    }
    print(record)
    write_json(args.out, [record])
    assert first_use <= RESTORE_FIRST_USE_BYTES, (
        f"the first use took {first_use / MIB:.1f} MiB, over the guard's {RESTORE_FIRST_USE_BYTES // MIB} MiB"
    )
    assert not any(changes), "a later restore or park changed the free memory"


if __name__ == "__main__":
    main()
