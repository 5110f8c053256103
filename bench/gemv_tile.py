"""The GEMV kernel's tile and warps for the Qwen3.5-0.8B shape's decode projections on the GPU (issue 20): each
projection a layer makes (the joined in-projection with its fused norm, the output projection, the gated
gate_up, down) timed by triton's do_bench, which empties the L2 cache before each run as a decode step finds it,
over two copies of the weights; the sum weighted by how often a step makes each (18 gated delta net layers, 6
attention layers) for each tile size and warp count, at 1 and 4 rows.

    python bench/gemv_tile.py [--rows 1 4] [--out docs/bench/gemv_tile.json]

do_bench's times include a launch each; a captured graph's are shorter, the differences between tiles the same.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import triton
from triton.testing import do_bench

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import commit_hash, write_json
from executor_svc.kernels.dependent import dependent
from executor_svc.kernels.gemv import _gemv_kernel

HIDDEN = 1024
# (projection, weight rows, K, gated, normed input, projections of this shape a decode step)
PROJECTIONS = (
    ("delta net in", 8224, HIDDEN, False, True, 18),
    ("delta net out", HIDDEN, 2048, False, False, 18),
    ("attention in", 5120, HIDDEN, False, True, 6),
    ("attention out", HIDDEN, 2048, False, False, 6),
    ("gate_up", 7168, HIDDEN, True, True, 24),
    ("down", HIDDEN, 3584, False, False, 24),
)


def projection_us(rows: int, n: int, k: int, gated: bool, norm: bool, tile: int, warps: int) -> float:
    device = "cuda"
    weights = [torch.randn(n, k, device=device, dtype=torch.bfloat16) for _ in range(2)]
    x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
    residual = torch.randn_like(x)
    norm_weight = torch.ones(k, device=device)
    n_out = n // 2 if gated else n
    out = torch.empty(rows, n_out, device=device, dtype=torch.bfloat16)
    new_residual = torch.empty_like(x)
    block_k = triton.next_power_of_2(k)
    block_n = max(1, min(64, tile // block_k))
    calls = [0]

    def call() -> None:
        weight = weights[calls[0] % 2]
        calls[0] += 1
        _gemv_kernel[(triton.cdiv(n_out, block_n),)](
            x, residual, norm_weight, weight, out, new_residual, rows, n_out, k, x.stride(0),
            residual.stride(0), out.stride(0), 1e-6, NORM=norm, HAS_RESIDUAL=norm, GATED=gated,
            BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, **dependent(x.device),
        )  # fmt: skip

    return do_bench(call, warmup=20, rep=100) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--tiles", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    parser.add_argument("--warps", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--commit", default=None, help="the commit measured (default: git's HEAD)")
    parser.add_argument("--out", default="docs/bench/gemv_tile.json")
    args = parser.parse_args()
    results = []
    for rows in args.rows:
        for tile in args.tiles:
            for warps in args.warps:
                each = {
                    name: round(projection_us(rows, n, k, gated, norm, tile, warps), 2)
                    for name, n, k, gated, norm, _ in PROJECTIONS
                }
                step = sum(each[name] * count for name, *_, count in PROJECTIONS)
                print(
                    f"rows {rows} tile {tile} warps {warps}: {step:.1f} us of projections a step", flush=True
                )
                results.append(
                    {
                        "rows": rows,
                        "tile": tile,
                        "warps": warps,
                        "step_us": round(step, 1),
                        "projections_us": each,
                    }
                )
    commit = args.commit or commit_hash()
    write_json(args.out, [{**r, "commit": commit} for r in results])


if __name__ == "__main__":
    main()
