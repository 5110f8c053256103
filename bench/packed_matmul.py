"""The packed-weight CPU kernel alone (issue 17): G weights/s of one matmul of a decode step's few rows, for
SmolLM2's shapes (q/k/v joined, o, gate/up joined, down in Q4_1 with float16 scales; the tied head in Q8_0),
random packed bytes, the same matrix again and again (so the smaller ones stay in the cache: an upper bound,
not a step's time).

    python bench/packed_matmul.py [--rows 1,4,8] [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from bench.common import commit_hash, write_json
from executor_svc.models import packed_kernel

# name, output rows N, input size K, bits
SHAPES: tuple[tuple[str, int, int, int], ...] = (
    ("qkv", 960, 576, 4),
    ("o", 576, 576, 4),
    ("gate_up", 3072, 576, 4),
    ("down", 576, 1536, 4),
)
SHAPES += (("head", 49152, 576, 8),)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 8])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="docs/bench/packed_matmul.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(0)
    results = []
    for m in args.rows:
        line = []
        for name, n, k, bits in SHAPES:
            q = torch.randint(0, 256, (n, k * bits // 8), dtype=torch.uint8, generator=generator)
            scale = (torch.rand(n, k // 32, generator=generator) * 0.01).half()
            minv = (torch.rand(n, k // 32, generator=generator) * -0.05).half() if bits == 4 else None
            x = torch.randn(m, k, generator=generator)
            for _ in range(3):
                packed_kernel.matmul(bits, 0, q, scale, minv, x)
            reps = max(3, int(2e8 // (n * k)))
            began = time.perf_counter()
            for _ in range(reps):
                packed_kernel.matmul(bits, 0, q, scale, minv, x)
            seconds = (time.perf_counter() - began) / reps
            results.append(
                {
                    "matrix": name,
                    "rows": m,
                    "n": n,
                    "k": k,
                    "bits": bits,
                    "us": round(seconds * 1e6, 1),
                    "g_weights_per_s": round(n * k / seconds / 1e9, 2),
                    "threads": args.threads,
                    "load_avg_1m": round(os.getloadavg()[0], 2),
                    "commit": commit_hash(),
                }
            )
            line.append(f"{name} {n * k / seconds / 1e9:5.2f}")
        print(f"rows {m}: G weights/s  " + "  ".join(line), flush=True)
    write_json(args.out, results)


if __name__ == "__main__":
    main()
