"""The skinny GEMM (executor_svc/kernels/skinny_gemm.py) against F.linear (cuBLAS) on the GPU, at the
Qwen3.5-0.8B shape's decode projections (those a step makes through Projections; the tied head is not one) and
a few row counts: each timed as a CUDA graph of one call a weight copy over enough copies that the weights
come from memory, not the L2 cache, as a decode step finds them; the per-step sum weighted by how often a step
makes each projection (18 gated delta net layers, 6 attention layers). --sweep also times the launch grid
(column block, K chunk, K splits) around the default and reports the best.

    python bench/skinny_gemm_vs_cublas.py [--rows 8 16 32 64] [--sweep [--block-n 64 128]]
        [--projections gate_up ...] [--out docs/bench/skinny_gemm.json]
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import captured_us, commit_hash, write_json
from executor_svc.kernels.skinny_gemm import SkinnyConfig, default_config, skinny_gemm

HIDDEN = 1024
# (projection, weight rows, K, projections of this shape a decode step); the gated gate_up is one projection
# of 2 I rows here, its SiLU * up a separate kernel on both paths
PROJECTIONS = (
    ("delta net in", 8224, HIDDEN, 18),
    ("delta net out", HIDDEN, 2048, 18),
    ("attention in", 5120, HIDDEN, 6),
    ("attention out", HIDDEN, 2048, 6),
    ("gate_up", 7168, HIDDEN, 24),
    ("down", HIDDEN, 3584, 24),
)
_COLD_BYTES = 256 << 20  # weight copies a graph cycles through: five times the H200's 50 MB L2
_REPLAYS = 10


def graph_us(call, copies: int) -> float:
    """Mean GPU time of call(i) over copies calls, captured in one graph and replayed."""

    def calls() -> None:
        for i in range(copies):
            call(i)

    return captured_us(calls, _REPLAYS) / copies


_SHARED_BYTES = 220 << 10  # an H100's or H200's shared memory a block, less some for the kernel's own


def candidates(
    rows: int, n: int, k: int, dtype: torch.dtype, block_ns: tuple[int, ...] = (16, 32, 64, 128, 256)
) -> list[SkinnyConfig]:
    """The launch grid: column blocks up to 256 (a wide projection's x tile is re-read from L2 once a column
    block, so a narrow block reads x more than its weights), K chunks, splits, warps and pipeline stages, where
    the grid has about one to eight programs an SM and the pipeline fits shared memory."""
    configs = []
    size = torch.tensor([], dtype=dtype).element_size()
    grid = itertools.product(block_ns, (64, 128, 256), (1, 2, 4, 8), (4, 8), (3, 4))
    for block_n, block_k, split_k, warps, stages in grid:
        programs = triton.cdiv(n, block_n) * split_k
        shared = stages * (max(16, rows) + block_n) * block_k * size
        if 66 <= programs <= 1100 and triton.cdiv(k, block_k) >= 2 * split_k and shared <= _SHARED_BYTES:
            configs.append(SkinnyConfig(block_n, block_k, split_k, warps, stages))
    return configs


def measure(rows: int, n: int, k: int, dtype: torch.dtype, sweep: tuple[int, ...]) -> dict:
    """cuBLAS and the default launch; with `sweep` (column blocks), the best of the launch grid too."""
    bytes_each = n * k * torch.tensor([], dtype=dtype).element_size()
    copies = max(2, min(128, _COLD_BYTES // bytes_each))
    weights = [torch.randn(n, k, device="cuda", dtype=dtype) * 0.05 for _ in range(copies)]
    x = torch.randn(rows, k, device="cuda", dtype=dtype)
    torch.testing.assert_close(skinny_gemm(x, weights[0]), F.linear(x, weights[0]), atol=5e-2, rtol=2e-2)
    result = {
        "linear_us": graph_us(lambda i: F.linear(x, weights[i]), copies),
        "default": default_config(rows, n, k, dtype)._asdict(),
        "skinny_us": graph_us(lambda i: skinny_gemm(x, weights[i]), copies),
    }
    if sweep:
        best = None
        for config in candidates(rows, n, k, dtype, sweep):
            try:
                us = graph_us(lambda i, c=config: skinny_gemm(x, weights[i], c), copies)
            except Exception as error:  # a grid whose pipeline does not fit the SM's shared memory
                print(f"  {config}: {type(error).__name__}", flush=True)
                continue
            if best is None or us < best[0]:
                best = (us, config)
        if best is not None:
            result["best_us"], result["best"] = best[0], best[1]._asdict()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, nargs="+", default=[8, 16, 32, 64])
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--sweep", action="store_true", help="also time the launch grid around the default")
    parser.add_argument(
        "--block-n", type=int, nargs="+", default=[16, 32, 64, 128, 256], help="column blocks the sweep tries"
    )
    names = [name for name, *_ in PROJECTIONS]
    parser.add_argument("--projections", nargs="+", choices=names, default=names, help="which to time")
    parser.add_argument("--commit", default=None, help="the commit measured (default: git's HEAD)")
    parser.add_argument("--out", default="docs/bench/skinny_gemm.json")
    args = parser.parse_args()
    results = []
    for dtype_name, rows in itertools.product(args.dtypes, args.rows):
        dtype = getattr(torch, dtype_name)
        each = {}
        for name, n, k, _count in PROJECTIONS:
            if name not in args.projections:
                continue
            sweep = tuple(args.block_n) if args.sweep and dtype == torch.bfloat16 else ()
            each[name] = measure(rows, n, k, dtype, sweep)
            print(dtype_name, rows, name, each[name], flush=True)
        step = {
            key: round(sum(each[name][key] * count for name, _, _, count in PROJECTIONS), 1)
            for key in ("linear_us", "skinny_us", "best_us")
            if len(each) == len(PROJECTIONS) and all(key in each[name] for name in each)
        }
        results.append({"dtype": dtype_name, "rows": rows, "step_us": step, "projections": each})
        print(dtype_name, rows, "a step:", step, flush=True)
    write_json(args.out, [{"commit": args.commit or commit_hash(), "results": results}])


if __name__ == "__main__":
    main()
