"""Park (put) and restore (get) throughput of the cache, checksums on, to a temp dir on local disk.

    python bench/cache_io.py [--size-mib 256] [--shards 30] [--rounds 3] [--dir DIR] [--out FILE]

One snapshot of --size-mib MiB in --shards layer shards (as a 30-layer model's KV pages would be), stored and
read back --rounds times by two arms: `store` calls the store in-process (disk, fsync, sha256 only), `grpc`
goes through CacheClient to a cache server in a child process (the service as deployed, over loopback).
A restore is timed warm (blobs in the page cache, right after the park) and cold (blobs dropped from the
page cache with posix_fadvise first). MB/s are 10^6 bytes a second.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from bench.common import commit_hash, write_json  # noqa: E402
from cache_svc import CHUNK_BYTES  # noqa: E402
from cache_svc.client import CacheClient  # noqa: E402
from cache_svc.index import SnapshotIndex  # noqa: E402
from cache_svc.manifest import Checkpoint, Manifest, Shard  # noqa: E402

TENANT, CONVERSATION = "bench", "bench-conversation"
SERVER_SCRIPT = """
import asyncio, sys
sys.path.insert(0, {repo!r})
from cache_svc.server import start_cache_server
from deltaserve.logs import configure_logging

configure_logging("warning")  # log lines go to stderr; stdout carries the port

async def main():
    server = await start_cache_server({root!r}, {budget})
    print(server.port, flush=True)
    await server.wait_for_termination()

asyncio.run(main())
"""


def make_snapshot(size_bytes: int, shards: int) -> tuple[dict, list[bytes]]:
    """A manifest dict and `shards` random blobs summing to size_bytes, one layer a shard."""
    rng = np.random.default_rng(0)
    sizes = [size_bytes // shards + (i < size_bytes % shards) for i in range(shards)]
    manifest = {
        "tenant": TENANT,
        "conversation_id": CONVERSATION,
        "token_ids": list(range(8192)),
        "checkpoints": [{"position": 8192, "pinned": False}],
        "model_fingerprint": "bench-model",
        "num_layers": shards,
        "page_size": 16,
        "dtype": "float32",
        "shards": [{"layers": [i, i + 1]} for i in range(shards)],
    }
    return manifest, [rng.integers(0, 256, size, dtype=np.uint8).tobytes() for size in sizes]


def store_manifest(manifest: dict, blobs: list[bytes]) -> Manifest:
    return Manifest(
        tenant=TENANT,
        conversation_id=CONVERSATION,
        token_ids=tuple(manifest["token_ids"]),
        checkpoints=tuple(Checkpoint(c["position"], c["pinned"]) for c in manifest["checkpoints"]),
        model_fingerprint=manifest["model_fingerprint"],
        num_layers=manifest["num_layers"],
        page_size=manifest["page_size"],
        dtype=manifest["dtype"],
        shards=tuple(
            Shard(s["layers"][0], s["layers"][1], len(b)) for s, b in zip(manifest["shards"], blobs)
        ),
    )


def drop_from_page_cache(root: str) -> None:
    """Evicts the (fsynced, so clean) blobs from the page cache: the next read comes from the disk."""
    for directory, _, names in os.walk(root):
        for name in names:
            fd = os.open(os.path.join(directory, name), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def timed(action) -> float:
    began = time.perf_counter()
    action()
    return time.perf_counter() - began


def run_store_arm(root: str, manifest: dict, blobs: list[bytes], rounds: int) -> dict[str, list[float]]:
    index = SnapshotIndex(root, budget_bytes=4 * sum(map(len, blobs)))
    parsed = store_manifest(manifest, blobs)
    seconds: dict[str, list[float]] = {"park": [], "restore": [], "restore-cold": []}
    try:
        for _ in range(rounds):
            seconds["park"].append(timed(lambda: index.put(parsed, blobs)))
            seconds["restore"].append(timed(lambda: index.read(TENANT, CONVERSATION)))
            drop_from_page_cache(root)
            seconds["restore-cold"].append(timed(lambda: index.read(TENANT, CONVERSATION)))
        assert index.read(TENANT, CONVERSATION)[1] == blobs
    finally:
        index.close()
    return seconds


async def run_grpc_arm(root: str, manifest: dict, blobs: list[bytes], rounds: int) -> dict[str, list[float]]:
    script = SERVER_SCRIPT.format(repo=REPO, root=root, budget=4 * sum(map(len, blobs)))
    server = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    seconds: dict[str, list[float]] = {"park": [], "restore": [], "restore-cold": []}
    try:
        assert server.stdout is not None  # stdout=PIPE
        port = int(server.stdout.readline())
        async with CacheClient(f"127.0.0.1:{port}") as client:
            await client.wait_ready(30)
            for _ in range(rounds):
                began = time.perf_counter()
                await client.put(manifest, blobs)
                seconds["park"].append(time.perf_counter() - began)
                for arm in ("restore", "restore-cold"):
                    if arm == "restore-cold":
                        drop_from_page_cache(root)
                    began = time.perf_counter()
                    _, restored = await client.get(TENANT, CONVERSATION)
                    seconds[arm].append(time.perf_counter() - began)
            assert restored == blobs
    finally:
        server.terminate()
        server.wait(30)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size-mib", type=int, default=256)
    parser.add_argument("--shards", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", default=None, help="parent of the temp dir (default: the system's temp dir)")
    parser.add_argument("--out", default="docs/bench/cache_io.json")
    args = parser.parse_args()

    manifest, blobs = make_snapshot(args.size_mib * 1024 * 1024, args.shards)
    size = sum(map(len, blobs))
    commit = commit_hash()
    results = []
    for arm in ("store", "grpc"):
        root = tempfile.mkdtemp(prefix=f"cache-io-{arm}-", dir=args.dir)
        try:
            if arm == "store":
                seconds = run_store_arm(root, manifest, blobs, args.rounds)
            else:
                seconds = asyncio.run(run_grpc_arm(root, manifest, blobs, args.rounds))
        finally:
            shutil.rmtree(root)
        for op, values in seconds.items():
            rates = [size / s / 1e6 for s in values]
            result = {
                "arm": arm,
                "op": op,
                "mb_s": round(statistics.median(rates), 1),
                "rounds": [round(r, 1) for r in rates],
                "size_bytes": size,
                "shards": args.shards,
                "chunk_bytes": CHUNK_BYTES,
                "checksum": "sha256",
                "commit": commit,
                "host": platform.node(),
                "cpus": os.cpu_count(),
            }
            results.append(result)
            print(f"{arm:5s} {op:12s} {result['mb_s']:8.1f} MB/s  rounds {result['rounds']}", flush=True)
    write_json(args.out, results)


if __name__ == "__main__":
    main()
