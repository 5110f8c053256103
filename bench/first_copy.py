"""The restore guard's first use on the GPU: what a card's copy stream and events cost (the reference allows
64 MiB against a measured need under 16 MiB), and that later copies leave the free memory where it was.

    python bench/first_copy.py [--out docs/bench/first_copy.json] [--commit HASH]

Copies a SmolLM2-sized shard (30 layers x 16 pages of K and V, bf16) from pinned host memory into a pool on
the card through executor_svc.copy_stream.CopyStream, as a restore does: the first time (the stream and
events are made), then six times more. Prints and records the free memory (cudaMemGetInfo) and torch's
allocated bytes around each.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import commit_hash, write_json
from executor_svc.copy_stream import CopyStream
from executor_svc.restore_guard import MIB, RESTORE_FIRST_USE_BYTES

LAYERS, PAGES, PAGE_SIZE, KV_HEADS, HEAD_DIM = 30, 16, 16, 3, 64


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="docs/bench/first_copy.json")
    parser.add_argument("--commit", default=None, help="the commit measured (default: git rev-parse HEAD)")
    args = parser.parse_args()
    device = torch.device("cuda")
    torch.cuda.init()
    # pool: [layers, pool pages, page_size, kv_heads, head_dim]; the host shard: the restored pages' part
    pool = torch.zeros(LAYERS, 1024, PAGE_SIZE, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device=device)
    host = torch.ones(LAYERS, PAGES, PAGE_SIZE, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16).pin_memory()
    index = torch.arange(1, PAGES + 1, device=device)
    staged = torch.empty_like(host, device=device)  # the shard on the card, as a restore stages it
    torch.cuda.synchronize()

    def restore(stream: CopyStream) -> None:
        with stream.copying():
            staged.copy_(host, non_blocking=True)
            pool.index_copy_(1, index, staged)
        torch.cuda.synchronize()

    stream = CopyStream(device)
    free_before = torch.cuda.mem_get_info(device)[0]
    restore(stream)
    free_after_first = torch.cuda.mem_get_info(device)[0]
    later = []
    for _ in range(6):
        restore(stream)
        later.append(torch.cuda.mem_get_info(device)[0])
    first_use = free_before - free_after_first
    record = {
        "bench": "first_copy",
        "commit": args.commit or commit_hash(),
        "gpu": torch.cuda.get_device_name(device),
        "first_use_bytes": first_use,
        "first_use_mib": round(first_use / MIB, 3),
        "allowance_mib": RESTORE_FIRST_USE_BYTES // MIB,
        "later_free_change_bytes": [free_after_first - free for free in later],
        "stream_ready": stream.ready,
    }
    print(record)
    assert first_use < 16 * MIB, f"the first use took {first_use / MIB:.1f} MiB, over the 16 MiB expected"
    assert all(free == free_after_first for free in later), "a later restore changed the free memory"
    write_json(args.out, [record])


if __name__ == "__main__":
    main()
